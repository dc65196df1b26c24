"""Round computed float sizes in ``zero_optimization`` (``0.9 * hidden**2``) to integers before DeepSpeed validates them.

Symptom
    ``deepspeed.initialize`` (or ``deepspeed.zero.Init``) refuses the config::

        pydantic_core._pydantic_core.ValidationError: 1 validation error for DeepSpeedZeroConfig
        stage3_prefetch_bucket_size
          Input should be a valid integer, got a number with a fractional part
          [type=int_from_float, input_value=57.6, input_type=float]

    when a script (or transformers <= 4.44.2 filling ``"auto"``) computes a
    size as a float, typically ``stage3_prefetch_bucket_size = 0.9 *
    hidden_size * hidden_size`` (deepspeedai/DeepSpeed#6525,
    LLaMA-Factory#5252, OpenBMB/MiniCPM-V#694).

Cause
    DeepSpeed 0.15.0 moved its config models from pydantic v1
    (``deepspeed.pydantic_v1``) to pydantic v2.  v1 coerced a float for an
    ``int`` field with ``int()`` (57.6 became 57, silently); v2's lax mode
    accepts a float only if it is integral and otherwise raises
    ``int_from_float``.  The ``int`` fields of ``DeepSpeedZeroConfig`` people
    compute: ``reduce_bucket_size``, ``allgather_bucket_size``,
    ``sub_group_size``, ``stage3_prefetch_bucket_size``,
    ``stage3_param_persistence_threshold``,
    ``stage3_model_persistence_threshold``, ``stage3_max_live_parameters``,
    ``stage3_max_reuse_distance`` (plus ``zero_hpz_partition_size``,
    ``mics_shard_size``/``stage3_module_granularity_threshold`` where the
    release has them, and the offload sections' ``buffer_count``,
    ``buffer_size``, ``max_in_cpu``).  transformers filled ``"auto"`` with
    the float ``0.9 * hidden_size * hidden_size`` up to 4.44.2 and with
    ``int(...)`` from 4.45 (4.45.2 read); accelerate 0.34.2 and later use
    ``int(...)`` (read in the wheels).

Affected versions
    DeepSpeed >= 0.15.0, read from the released sdists: 0.14.4 and 0.14.5
    (the last 0.14) import ``BaseModel`` from ``deepspeed.pydantic_v1``;
    0.15.0 imports it from ``pydantic`` (v2) in ``runtime/config_utils.py``,
    and so does every release since (0.15.4, 0.16.0, 0.16.9, 0.19.2, 0.19.8
    read).  That import is the source fingerprint.

Flag
    ``ZEROSHIM_ZERO_CONFIG_FLOAT_SIZES=auto|on|off`` (default ``auto``).

Fix
    ``get_zero_config(param_dict)`` (what ``DeepSpeedConfig`` calls to build
    ``DeepSpeedZeroConfig``) is wrapped: where ``zero_optimization`` holds,
    for a field the model types ``int`` (found in the model's own fields, by
    alias and by name, offload sections included), a float that is finite,
    not negative and not integral, the original is called with a copy in
    which that value is rounded to the nearest integer (``round``); the
    user's dict is not changed.  Nothing else is touched: integers, integral
    floats (valid already), strings, booleans, negative or non-finite floats
    (DeepSpeed's own error stays) and other fields.  One INFO line per
    job (it acts only where DeepSpeed would refuse the config: each field, its value, the rounded value, the
    flag).  DeepSpeed 0.14 truncated instead (``int()``, as transformers
    and accelerate do now); the two differ only for a fraction of .5 or
    more, which makes no difference to a bucket size.
    ``zeroshim doctor --config`` names such values on affected releases.

Undo
    ``zeroshim.unpatch("zero_config_float_sizes")`` restores ``get_zero_config``.
"""

from __future__ import annotations

import math

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "zero_config_float_sizes"
#: rounded: values rounded ("zero_optimization.<key>", value, rounded), in order
stats = {"rounded": []}
ZERO = "zero_optimization"
#: the int fields of DeepSpeedZeroConfig (0.15.0 - 0.19.8) by the keys configs use, for
#: ``zeroshim doctor --config`` (which imports nothing); at run time the model's own fields decide
DOCTOR_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "stage3_prefetch_bucket_size",
               "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
               "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_module_granularity_threshold",
               "zero_hpz_partition_size", "mics_shard_size")


def _fields(model) -> dict:
    """key (alias and name) -> None for an ``int`` field, or the model class of a nested section."""
    import typing  # here, not at import: ``import zeroshim`` stays cheap (issue #47 item 8)

    out = {}
    for name, field in getattr(model, "model_fields", {}).items():
        annotation = field.annotation
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        kind = args[0] if len(args) == 1 else annotation
        if kind is int:
            value = None
        elif isinstance(kind, type) and hasattr(kind, "model_fields"):
            value = kind
        else:
            continue
        for key in {name, field.alias} - {None}:
            out[key] = value
    return out


def _fractional(value) -> bool:
    return (type(value) is float and math.isfinite(value) and value >= 0 and not value.is_integer())


def _rounded(section: dict, model, where: str, changes: list) -> dict:
    """A copy of ``section`` with its fractional floats of int fields rounded (``section`` itself if none)."""
    fields = _fields(model)
    out = section
    for key, value in section.items():
        if key not in fields:
            continue
        nested = fields[key]
        if nested is None and _fractional(value):
            new = round(value)
        elif nested is not None and isinstance(value, dict):
            new = _rounded(value, nested, f"{where}.{key}", changes)
            if new is value:
                continue
        else:
            continue
        if out is section:
            out = dict(section)
        out[key] = new
        if nested is None:
            changes.append((f"{where}.{key}", value, new))
    return out


def _make_get_zero_config(model):
    def _get_zero_config(wrapped, instance, args, kwargs):
        """Wraps ``deepspeed.runtime.config.get_zero_config(param_dict)``."""
        with guard(NAME):
            param_dict = args[0] if args else kwargs.get("param_dict")
            zero = param_dict.get(ZERO) if isinstance(param_dict, dict) else None
            if is_active(NAME) and isinstance(zero, dict):
                changes = []
                fixed = _rounded(zero, model, ZERO, changes)
                if changes:
                    stats["rounded"].extend(changes)
                    _log.acted(NAME, "rounded %s (write integers to silence this)",
                               "DeepSpeed >= 0.15 validates these integer fields with pydantic v2 and refuses a "
                               "number with a fractional part", ", ".join(f"{k}={v!r} to {n}" for k, v, n in changes))
                    param_dict = dict(param_dict)
                    param_dict[ZERO] = fixed
                    args, kwargs = ((param_dict,) + tuple(args[1:]), kwargs) if args else \
                        ((), {**kwargs, "param_dict": param_dict})
        return wrapped(*args, **kwargs)

    return _get_zero_config


def patch_runtime_config(module, patcher: Patcher) -> None:
    require_params(require_attr(module, "get_zero_config"), "param_dict")
    from deepspeed.runtime.zero import config as zero_config  # noqa: PLC0415 (imported with its target)

    model = require_attr(zero_config, "DeepSpeedZeroConfig")
    require_attr(model, "model_fields")  # pydantic v2 (DeepSpeed >= 0.15)
    patcher.wrap(module, "get_zero_config", _make_get_zero_config(model))


def check_config(cfg, affected: bool) -> list:
    """``zeroshim doctor --config``: integer sizes written as fractional floats, on releases that refuse them."""
    if not affected:
        return []
    from zeroshim import _versions

    findings = []
    for key in DOCTOR_KEYS:
        value = cfg.zero.get(key)
        if _fractional(value):
            findings.append({"level": "error",
                             "message": f"{ZERO}.{key}={value!r} is not an integer: deepspeed "
                                        f"{_versions.installed('deepspeed')} refuses it (\"Input should be a valid "
                                        f"integer, got a number with a fractional part\"); write {round(value)} "
                                        "(zeroshim rounds it when it is imported)."})
    return findings


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="a computed float size in zero_optimization (stage3_prefetch_bucket_size = 0.9 * hidden**2): "
            "\"Input should be a valid integer, got a number with a fractional part\"",
    signatures=((r"Input should be a valid integer, got a number with a fractional part",
                 r"validation errors? for DeepSpeedZeroConfig"),),
    versions_note="pydantic v2 configs",
    affects={"deepspeed": ">=0.15.0"},
    fingerprint=Fingerprint("deepspeed.runtime.config_utils", r"(?m)^from pydantic import [^\n]*\bBaseModel\b",
                            "DeepSpeed's config models on pydantic v2 (from pydantic import BaseModel)"),
    targets={"deepspeed.runtime.config": patch_runtime_config},
    check_config=check_config,
)
