"""Fill ``"auto"`` ZeRO bucket sizes from ``config.text_config`` for multimodal models in HF Trainer up to 4.45.

Symptom
    ``Trainer(model, args=TrainingArguments(deepspeed=<config>))`` with a
    DeepSpeed config holding ``"reduce_bucket_size": "auto"``,
    ``"stage3_prefetch_bucket_size": "auto"`` or
    ``"stage3_param_persistence_threshold": "auto"`` (the usual ``zero3.json``)
    refuses a multimodal model (LLaVA, Idefics2, Mllama, PaliGemma, ... : the
    language model's hidden size only in ``config.text_config``) when it
    starts training::

        ValueError: The model's config file has neither `hidden_size` nor `hidden_sizes` entry, therefore
        it's not possible to automatically fill out the following `auto` entries in the DeepSpeed config
        file: ['zero_optimization.reduce_bucket_size', ...]. You can fix that by replacing `auto` values
        for these keys with an integer value of your choice.

    Reports: LLaMA-Factory #4754 (LLaVA, transformers 4.42), and ms-swift's
    ``compat_zero3`` and LLaMA-Factory's ``visual.py`` copy
    ``text_config.hidden_size`` onto the config for that reason.

Cause
    ``HfTrainerDeepSpeedConfig.trainer_config_finalize`` fills the three
    values from ``model.config.hidden_size`` (``hidden * hidden``,
    ``int(0.9 * hidden * hidden)``, ``10 * hidden``), else the largest of
    ``hidden_sizes``, else raises.  transformers 4.46.0 (#33829, for Mllama)
    falls back to ``text_config``.

Affected versions
    transformers 4.33.0 (where ``integrations/deepspeed.py`` begins) to
    4.45.2, read in the released wheels 4.33.0, 4.40.2, 4.44.2 and 4.45.2
    (the raise, no ``text_config``); 4.46.0 reads ``text_config``.  4.32.1
    and older raise the same in ``transformers/deepspeed.py`` (read in the
    4.32.1 wheel): not handled here (no target there).  Any DeepSpeed.  The source fingerprint: that raise in a file that never reads
    ``text_config``.  accelerate's own preparation has the same limitation
    (patch ``zero_auto_hidden_size``): with "auto" left for a ZeRO-1/2
    config's ``stage3_*`` entries Trainer 4.45 raises here first.

Flag
    ``ZEROSHIM_TRAINER_AUTO_HIDDEN_SIZE=auto|on|off`` (default ``auto``).

Fix
    ``HfTrainerDeepSpeedConfig.trainer_config_finalize(args, model, ...)`` is
    wrapped.  Before it runs, where ``model.config`` has neither
    ``hidden_size`` nor ``hidden_sizes`` but its ``text_config`` has one of
    them, each of the three entries still ``"auto"`` is filled with the value
    transformers 4.46 gives (the text model's ``hidden_size``, else the
    largest of its ``hidden_sizes``; the same three formulas), through the
    config's own ``fill_only``.  transformers 4.46 fills the ``stage3_*``
    entries only under ZeRO-3; here they are filled under every stage, where
    4.45 would raise instead (DeepSpeed reads them only under ZeRO-3).
    Numbers the user wrote, models with a top-level hidden size and configs
    without a text hidden size are left alone (transformers' own behaviour,
    error included).  One INFO line per job (it acts only where Trainer
    would fail).

Undo
    ``zeroshim.unpatch("trainer_auto_hidden_size")`` restores
    ``trainer_config_finalize``.

Evidence
    benchmarks/RESULTS.md, section 42.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "trainer_auto_hidden_size"
#: filled: ("zero_optimization.<key>", value) for each "auto" entry filled, in order
stats = {"filled": []}


def _fill(config, model) -> None:
    from zeroshim.patches.zero_auto_hidden_size import KEYS, _sizes, _text_hidden_size

    auto = [key for key in KEYS if config.is_auto(key)]
    hidden = _text_hidden_size(getattr(model, "config", None)) if auto else None
    if hidden is None:
        return
    sizes = _sizes(hidden)
    for key in auto:
        config.fill_only(key, sizes[key])
        stats["filled"].append((key, sizes[key]))
    _log.acted(NAME, "filled the \"auto\" entries %s from the model's text_config.hidden_size=%d",
               "the model's config (%s) has no top-level hidden_size and HF Trainer up to transformers 4.45 reads "
               "only that (4.46 falls back to text_config the same way)",
               ", ".join(f"{key}={sizes[key]}" for key in auto), hidden, type(model.config).__name__)


def _trainer_config_finalize(wrapped, instance, args, kwargs):
    """Wraps ``HfTrainerDeepSpeedConfig.trainer_config_finalize(self, args, model, num_training_steps)``."""
    with guard(NAME):
        model = args[1] if len(args) > 1 else kwargs.get("model")
        if instance is not None and model is not None and is_active(NAME):
            _fill(instance, model)
    return wrapped(*args, **kwargs)


def patch_deepspeed_integration(module, patcher: Patcher) -> None:
    cls = require_attr(module, "HfTrainerDeepSpeedConfig")
    method = require_attr(cls, "trainer_config_finalize")
    require_params(method, "args", "model", "num_training_steps")
    require_attr(cls, "is_auto")
    require_attr(cls, "fill_only")
    patcher.wrap(cls, "trainer_config_finalize", _trainer_config_finalize)


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="HF Trainer (transformers ≤ 4.45) with \"auto\" ZeRO bucket sizes on a multimodal model (hidden size "
            "only in text_config): \"The model's config file has neither `hidden_size` nor `hidden_sizes` entry\"",
    signatures=(r"The model's config file has neither `hidden_size` nor `hidden_sizes` entry",),
    versions_note="HF Trainer's own fill; transformers ≥ 4.46 falls back to text_config itself",
    affects={"transformers": ">=4.33.0,<4.46.0"},
    fingerprint=Fingerprint("transformers.integrations.deepspeed",
                            r"(?s)\A(?!.*\btext_config\b).*neither `hidden_size` nor `hidden_sizes` entry",
                            "Trainer's hidden-size error for \"auto\" bucket sizes, in an integrations/deepspeed.py "
                            "that never reads text_config"),
    targets={"transformers.integrations.deepspeed": patch_deepspeed_integration},
)
