"""Let peft build LoRA ``target_parameters`` wrappers for parameters ZeRO-3 has already partitioned.

Symptom
    ``get_peft_model`` with ``LoraConfig(target_parameters=[...])`` (LoRA on
    a parameter rather than a module: fused MoE experts such as
    ``mlp.experts.gate_up_proj``, or any 2-D weight) fails under DeepSpeed
    ZeRO-3 with ``IndexError: tuple index out of range`` in
    ``peft/tuners/lora/layer.py`` (``... = 1, param.shape[1], param.shape[0]``),
    when the model was built under ``deepspeed.zero.Init`` (HF
    ``from_pretrained`` with a ZeRO-3 ``TrainingArguments``/``HfDeepSpeedConfig``
    alive, accelerate's ``zero3_init_flag: true``, TRL, LLaMA-Factory).
    Reports: peft #2855, #2916.

Cause
    ``lora.ParamWrapper`` reads the targeted parameter's ``shape`` and ``ndim``
    when it is built.  Under ``zero.Init`` the parameter is already a
    partition placeholder of shape ``[0]``; its real shape is in ``ds_shape``.
    (Built without ``zero.Init``, the parameters are partitioned later, by
    ``deepspeed.initialize``, and the wrapper trains: at run time DeepSpeed's
    parameter dictionary gathers a parameter read outside its module's
    forward.)

Affected versions
    peft ``>=0.17.0,<0.21.0``.  From the released sdists: 0.16.0 has no
    ``ParamWrapper`` (``target_parameters`` arrived in 0.17.0); 0.17.0 to
    0.20.0 read ``param.shape[1], param.shape[0]`` (0.17 in ``__init__``,
    0.18+ in ``_get_in_out_features``, and ``update_layer`` re-reads
    ``param.ndim``); 0.21.0 reads ``ds_shape`` and carries the rank to
    ``update_layer`` (peft #3576), so the issue's "not yet released" is out of
    date.  The source fingerprint (the ``param.shape[1], param.shape[0]``
    line) matches exactly 0.17.0-0.20.0 among 0.16.0-0.21.2.  Any DeepSpeed
    with ZeRO-3.

Flag
    ``ZEROSHIM_ZERO3_LORA_TARGET_PARAMETERS=auto|on|off`` (default ``auto``).

Fix
    ``peft.tuners.lora.layer.ParamWrapper.__init__`` is wrapped: when the
    parameter it targets is a ZeRO-3 partition placeholder (its ``shape`` is
    not its ``ds_shape``), the original ``__init__`` runs inside
    ``deepspeed.zero.GatheredParameters([param], modifier_rank=None)``, so
    every shape peft reads is the real one; the parameter is re-partitioned,
    unchanged, on exit (read-only gather: nothing is broadcast back).  This is
    the workaround peft's maintainers suggested (#2916), one parameter at a
    time.  The gather is a collective: ranks build their peft models
    together, as they do under ZeRO-3 anyway.  If the gather itself cannot be
    made (no process group), peft's own error is left to surface.

Undo
    ``zeroshim.unpatch("zero3_lora_target_parameters")`` restores the method
    (wrappers already built keep their correct shapes).

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero3_lora_target_parameters``.
"""

from __future__ import annotations

import contextlib

from zeroshim import _agree, _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "zero3_lora_target_parameters"
#: targeted parameters gathered while their wrapper was built (introspection and tests)
stats = {"gathered": 0}


def _target(args, kwargs):
    """The parameter ``ParamWrapper(base_layer, adapter_name, parameter_name, ...)`` targets, if it is a
    ZeRO-3 partition placeholder; else None.  (A wrapper around a wrapper targets its innermost layer.)"""
    base = args[0] if args else kwargs.get("base_layer")
    name = args[2] if len(args) > 2 else kwargs.get("parameter_name")
    while hasattr(base, "base_layer"):
        base = base.base_layer
    param = getattr(base, name, None) if isinstance(name, str) else None
    shape = getattr(param, "ds_shape", None)
    if shape is None or tuple(param.shape) == tuple(shape):
        return None
    return param


def _init(wrapped, instance, args, kwargs):
    """Wraps ``ParamWrapper.__init__``."""
    gather = None
    with guard(NAME):
        param = _target(args, kwargs) if is_active(NAME) else None
        if param is not None and not _agree.before_acting(NAME, "peft's LoRA target_parameters wrappers"):
            param = None  # the ranks disagreed: off on every rank
        if param is not None:
            import deepspeed

            gather = contextlib.ExitStack()
            gather.enter_context(deepspeed.zero.GatheredParameters([param], modifier_rank=None))
            stats["gathered"] += 1
            _log.acted(NAME, "gathered each ZeRO-3 partitioned parameter while peft built its LoRA "
                             "target_parameters wrapper", "peft reads the parameter's shape there, and a partition's "
                             "is [0]")
    if gather is None:
        return wrapped(*args, **kwargs)
    with gather:
        return wrapped(*args, **kwargs)


def patch_lora_layer(module, patcher: Patcher) -> None:
    cls = require_attr(module, "ParamWrapper")
    require_params(cls.__init__, "base_layer", "adapter_name", "parameter_name")
    patcher.wrap(cls, "__init__", _init)


PATCH = Patch(
    changes=('error', 'collectives'),
    name=NAME,
    summary="peft LoRA target_parameters on a model built under ZeRO-3 (zero.Init): IndexError: tuple index "
            "out of range in ParamWrapper",
    signatures=((r"IndexError: tuple index out of range", r"param\.shape\[1\], param\.shape\[0\]"),),
    affects={"peft": ">=0.17.0,<0.21.0", "deepspeed": ""},
    fingerprint=Fingerprint("peft.tuners.lora.layer", r"1, param\.shape\[1\], param\.shape\[0\]",
                            "ParamWrapper reading the targeted parameter's partitioned shape "
                            "(param.shape[1], param.shape[0]; peft #3576 reads ds_shape)", bug_when="present"),
    targets={"peft.tuners.lora.layer": patch_lora_layer},
)
