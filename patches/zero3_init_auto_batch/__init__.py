"""Let ``deepspeed.zero.Init`` take a config whose batch sizes are ``"auto"`` or not given, as it never uses them.

Symptom
    Loading a model under ZeRO-3 before the HF Trainer has filled the config fails before anything is built::

        TypeError: '>' not supported between instances of 'str' and 'int'

    (``TypeError: can't multiply sequence by non-int of type 'str'`` where ``train_batch_size`` is not in the
    config) raised in DeepSpeed's batch checks from ``deepspeed.zero.Init`` inside ``from_pretrained`` /
    ``from_config``, where the script registered the Trainer-style config itself --
    ``HfDeepSpeedConfig(ds_config)`` (transformers' documented way to load under ZeRO-3 without the Trainer) or
    ``HfTrainerDeepSpeedConfig(ds_config)`` -- with ``"train_micro_batch_size_per_gpu": "auto"`` (or
    ``gradient_accumulation_steps`` / ``train_batch_size`` ``"auto"``), as the config files shipped for the HF
    Trainer have them (TRL #2154, open; Roblox/FAI-RL PRs #70 and #72, June 2026).  The same for
    ``deepspeed.zero.Init(config_dict_or_path=...)`` called directly.  A config that gives neither
    ``train_batch_size`` nor ``train_micro_batch_size_per_gpu`` (an inference config) fails instead with
    ``AssertionError: Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided``.

Cause
    ``zero.Init`` builds a whole ``DeepSpeedConfig`` from the config to read its ZeRO and dtype sections, and
    ``DeepSpeedConfig.__init__`` always derives and checks the batch sizes (``_configure_train_batch_size``),
    which ``zero.Init`` never reads.  ``"auto"`` is a placeholder only the HF Trainer and accelerate fill (when
    ``TrainingArguments`` or ``prepare`` run, often after the model is loaded).  accelerate fills the three with
    1, 1 and nothing for its own ``zero.Init`` config (``DeepSpeedPlugin.__post_init__``, read in 1.7.0); axolotl
    fills them by hand before loading (``_configure_zero3_memory_efficient_loading``, ``fill_match``).

Affected versions
    Every DeepSpeed whose ``zero.Init`` builds a ``DeepSpeedConfig`` from ``config_dict_or_path``: the line is in
    0.14.1, 0.16.9, 0.17.6, 0.18.0-0.18.6 and 0.19.0-0.19.8 (read in the sdists), with the batch checks in
    ``runtime/config.py`` (run: 0.18.5, 0.19.2, 0.19.8).  That line is the source fingerprint.

Flag
    ``ZEROSHIM_ZERO3_INIT_AUTO_BATCH=auto|on|off`` (default ``auto``).

Fix
    ``zero.Init.__init__`` is wrapped: where its config (``config``, which it takes over
    ``config_dict_or_path``, else ``config_dict_or_path``) is a dict -- or the path of a JSON file holding one,
    without duplicate keys (DeepSpeed refuses those) -- that DeepSpeed would refuse for its batch entries alone
    (one of ``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` is
    ``"auto"``, or neither of the first two is given), ``zero.Init`` gets a copy with micro-batch 1,
    accumulation 1 and no ``train_batch_size`` (accelerate's choice for its own ``zero.Init``; valid at any
    world size).  Nothing else in the config changes, the caller's dict and file are not touched, and what
    ``zero.Init`` builds is what the same config with numbers there builds, bit for bit (the values are never
    read).  Left to DeepSpeed as given: a config with elasticity enabled, a ``None`` config, concrete batch
    sizes (right or wrong: DeepSpeed's own check stays), anything that is not a dict or a JSON file, and, on
    DeepSpeed < 0.17.1 (no ``runtime/precision_config.py``; read in the 0.17.0 and 0.17.1 sdists), a config
    whose ``fp16`` or ``bf16`` says ``"enabled": "auto"``: those releases read that ``"auto"`` as on, so
    ``zero.Init`` would build the model in that dtype where the Trainer may later fill it with false (0.17.1
    and later drop ``"auto"`` to the default, off).  ``MiCS_Init`` builds its own ``DeepSpeedConfig`` first and
    is not covered.  One INFO line per job (it acts only where DeepSpeed would refuse the config).

Undo
    ``zeroshim.unpatch("zero3_init_auto_batch")`` restores ``zero.Init.__init__``.

Evidence
    benchmarks/RESULTS.md, ``zero3_init_auto_batch``.
"""

from __future__ import annotations

import os

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr
from zeroshim._source import Fingerprint

NAME = "zero3_init_auto_batch"
#: given: per call that acted, the batch entries the config had ({key: value}; absent keys left out)
stats = {"given": []}
AUTO = "auto"
TRAIN, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
BATCH = (TRAIN, MICRO, GAS)
#: zero.Init's frame in a traceback (not just a log line of partition_parameters.py): the same errors from
#: deepspeed.initialize are the config's own
INIT_FRAME = r'partition_parameters\.py", line \d+, in __init__'
#: the precision sections whose "enabled" DeepSpeed < 0.17.1 reads as given ("auto" counts as on)
PRECISION = ("fp16", "bf16", "bfloat16")
_where: dict = {}


def refused(config: dict) -> bool:
    """Whether DeepSpeed's ``DeepSpeedConfig`` refuses ``config`` for its batch entries alone: one is ``"auto"``,
    or neither ``train_batch_size`` nor ``train_micro_batch_size_per_gpu`` is given (elasticity, which computes
    the batch sizes itself, left out)."""
    elasticity = config.get("elasticity")
    if isinstance(elasticity, dict) and elasticity.get("enabled"):
        return False
    if any(config.get(key) == AUTO for key in BATCH):
        return True
    return config.get(TRAIN) is None and config.get(MICRO) is None


def precision_auto(config: dict) -> bool:
    """Whether an ``fp16``/``bf16`` section says ``"enabled": "auto"`` (DeepSpeed < 0.17.1 takes it as on)."""
    return any(isinstance(config.get(key), dict) and config[key].get("enabled") == AUTO for key in PRECISION)


def accepted(config: dict) -> dict:
    """A copy of ``config`` with micro-batch 1, accumulation 1 and no ``train_batch_size`` (valid at any world
    size; ``zero.Init`` reads none of them)."""
    out = {key: value for key, value in config.items() if key != TRAIN}
    out.update({MICRO: 1, GAS: 1})
    return out


def _read(path) -> "dict | None":
    """The dict in the JSON file at ``path`` (read with DeepSpeed's own refusal of duplicate keys), or None (not a
    file, not JSON, duplicate keys, not a dict): then DeepSpeed reads the path itself, with its own errors."""
    import json

    try:
        from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
    except ImportError:
        return None
    try:
        if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as handle:
            loaded = json.load(handle, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _given(config: dict) -> dict:
    """The batch entries ``config`` has (absent keys left out)."""
    return {key: config[key] for key in BATCH if key in config}


def _shown(given: dict, none: str) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in given.items()) or none


def _config_argument(positions: dict, args, kwargs) -> "tuple | None":
    """``(name, position, value)`` of the config ``zero.Init`` reads: ``config`` where given (it takes it over
    ``config_dict_or_path``), else ``config_dict_or_path``; None where neither is given."""
    for key in ("config", "config_dict_or_path"):
        position = positions[key]
        value = args[position] if len(args) > position else kwargs.get(key)
        if value is not None:
            return key, position, value
    return None


def _make_init(positions: dict):
    def _init(wrapped, instance, args, kwargs):
        """Wraps ``deepspeed.zero.Init.__init__(module=None, ..., config_dict_or_path=None, config=None, ...)``
        (``positions``: where the two configs come among the positional arguments, ``self`` not counted)."""
        with guard(NAME):
            found = _config_argument(positions, args, kwargs) if is_active(NAME) else None
            if found is not None:
                key, position, given = found
                config = given if isinstance(given, dict) else _read(given)
                # else DeepSpeed reads it as given (and its own error stays)
                if config is not None and refused(config) and not (precision_auto(config)
                                                                   and not _where.get("precision_models")):
                    batch = _given(config)
                    stats["given"].append(batch)
                    if len(args) > position:
                        args = args[:position] + (accepted(config),) + tuple(args[position + 1:])
                    else:
                        kwargs = {**kwargs, key: accepted(config)}
                    _log.acted(NAME, "zero.Init got its config with micro-batch 1, accumulation 1 and no "
                                     "train_batch_size (given: %s; the model is built as with numbers there)",
                               "zero.Init validates the batch sizes it never uses, and refuses \"auto\" (a value "
                               "the HF Trainer fills later) or a config without them", _shown(batch, "none"))
        return wrapped(*args, **kwargs)

    return _init


def patch_partition_parameters(module, patcher: Patcher) -> None:
    import inspect

    cls = require_attr(module, "Init")
    names = list(inspect.signature(require_attr(cls, "__init__")).parameters)
    require(names[:1] == ["self"] and "config_dict_or_path" in names and "config" in names,
            f"zero.Init.__init__ takes ({', '.join(names)}), without config_dict_or_path and config")
    positions = {key: names.index(key) - 1 for key in ("config_dict_or_path", "config")}
    # DeepSpeed >= 0.17.1 reads fp16/bf16 through pydantic models that drop "auto" (off); before, "enabled": "auto"
    # counts as on, so a config with it is left to DeepSpeed there (zero.Init would build the model in that dtype)
    import importlib.util

    _where["precision_models"] = importlib.util.find_spec("deepspeed.runtime.precision_config") is not None
    patcher.wrap(cls, "__init__", _make_init(positions))


def check_config(cfg, affected: bool) -> list:
    """``zeroshim doctor --config``: batch sizes that ``zero.Init`` refuses where a script registers the config
    before the HF Trainer fills it."""
    if not affected or cfg.stage != 3 or not isinstance(cfg.raw, dict) or not refused(cfg.raw):
        return []
    shown = _shown(_given(cfg.raw), "no batch size")
    return [{"level": "info",
             "message": f"ZeRO-3 config with {shown}: deepspeed.zero.Init refuses it where a script registers it "
                        "itself (HfDeepSpeedConfig before from_pretrained, or zero.Init(config_dict_or_path=...)) "
                        "before the HF Trainer or accelerate fills the batch sizes; zeroshim lets zero.Init take "
                        "it when it is imported."}]


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="zero.Init (from_pretrained under HfDeepSpeedConfig, or called directly) with \"auto\" or no batch "
            "sizes in the config: \"'>' not supported between instances of 'str' and 'int'\" / \"Either "
            "train_batch_size or train_micro_batch_size_per_gpu needs to be provided\"",
    signatures=((r"TypeError: (?:'>' not supported between instances of 'str' and 'int'|can't multiply sequence by "
                 r"non-int of type 'str')", r"_batch_assertion|_set_batch_related_parameters", INIT_FRAME),
                (r"Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided", INIT_FRAME)),
    versions_note="every zero.Init that validates its config",
    affects={"deepspeed": ""},
    fingerprint=Fingerprint("deepspeed.runtime.zero.partition_parameters", r"DeepSpeedConfig\(\s*config_dict_or_path",
                            "zero.Init building a whole DeepSpeedConfig (batch checks included) from its config"),
    targets={"deepspeed.runtime.zero.partition_parameters": patch_partition_parameters},
    check_config=check_config,
)
