"""Gather ZeRO-3 parameters of different dtypes in one blocking gather without a dtype clash.

Symptom
    ZeRO-3 + bf16 (or fp16) with peft LoRA on a model built under
    ``deepspeed.zero.Init`` (HF ``from_pretrained`` with a ZeRO-3
    ``TrainingArguments`` alive, accelerate's ``zero3_init_flag``, TRL's
    trainers) fails at the first optimizer step, in ``_post_step`` (the
    gather of the persistent parameters), with ``TypeError: output tensor
    must have the same type as input tensor`` on NCCL
    (deepspeedai/DeepSpeed#8072, huggingface/trl#6089), or on gloo/CPU with
    ``RuntimeError: ProcessGroupGloo::allgather: invalid tensor type at index
    0``.  Any other blocking gather of several parameters of different
    dtypes (``GatheredParameters`` over a bf16 base weight and an fp32
    adapter) fails the same way.

Cause
    ``Init._allgather_params_coalesced`` allocates every output buffer of a
    blocking gather in the dtype of the *first* parameter in the list
    (``dtype=param_list[0].ds_tensor.dtype``) and all-gathers each
    parameter's own shard into its buffer; shards of another dtype do not
    fit.  peft's default ``autocast_adapter_dtype=True`` keeps LoRA adapters
    in fp32 while the base model is bf16, and both kinds are small enough to
    persist (``stage3_param_persistence_threshold``, default 1e5 elements;
    HF's ``auto`` is 10 * hidden size), so ``_post_step`` gathers them
    together.  Up to 0.19.1 ``_configure_distributed_model`` cast the whole
    module to bf16/fp16 (``module.bfloat16()``) before the adapters became
    ZeRO parameters, which made every dtype equal; 0.19.2 stopped casting
    ZeRO-Init models (#8066) and so exposed the gather.

Affected versions
    DeepSpeed < 0.19.3, read from the released sdists: 0.14.1, 0.16.9,
    0.19.0, 0.19.1 and 0.19.2 allocate ``dtype=param_list[0].ds_tensor.dtype``;
    0.19.3 allocates each buffer in its own parameter's dtype (#8073), as
    0.19.8 does.  Reached through peft/Trainer on 0.19.2 only: 0.14.1,
    0.16.9, 0.19.0 and 0.19.1 cast the module with ``module.bfloat16()`` in
    ``_configure_distributed_model``, 0.19.2 skips the cast for ZeRO-Init
    models (``_cast_module_mixed_precision``).  The source fingerprint is the
    line ``dtype=param_list[0].ds_tensor.dtype``.  The quantized-weights variant (the scale
    buffers, #8128) is not covered.

Flag
    ``ZEROSHIM_ZERO3_MIXED_DTYPE_GATHER=auto|on|off`` (default ``auto``).

Fix
    ``Init._all_gather`` (the blocking gather that hands its parameters to
    ``_allgather_params_coalesced``) is wrapped: when a blocking call
    (``async_op=False``) is given parameters whose shards have more than
    one dtype, DeepSpeed's own ``_all_gather`` is called once per dtype, the
    groups in the order their dtype first appears, so each coalesced gather
    sees one dtype -- what 0.19.3 does buffer by buffer.  Every rank holds
    the same list and splits it the same way, so the collectives still
    match.  A gather is a copy, so the values are those of an unsplit
    gather; lists of one dtype, async gathers and unaffected versions are
    untouched.  One INFO line per job, by the first rank that acts.
    It is independent of patch ``zero3_gloo_gather`` (which, on gloo,
    gathers inside ``_allgather_params_coalesced`` one parameter at a time
    and so also avoids the mixed buffer there, but not on NCCL).

Undo
    ``zeroshim.unpatch("zero3_mixed_dtype_gather")`` restores
    ``Init._all_gather``.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero3_mixed_dtype_gather``.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "zero3_mixed_dtype_gather"
#: regrouped: blocking gathers of parameters of several dtypes split into one gather per dtype
stats = {"regrouped": 0}


def _bind(param_list, async_op=False, hierarchy=None):
    return param_list, async_op, hierarchy


def _by_dtype(params) -> "list | None":
    """The parameters grouped by the dtype of their shard (first-seen order), or None if there is one dtype."""
    groups = {}
    for param in params:
        groups.setdefault(getattr(getattr(param, "ds_tensor", None), "dtype", None), []).append(param)
    return list(groups.values()) if len(groups) > 1 else None


def _all_gather(wrapped, instance, args, kwargs):
    """Wraps ``Init._all_gather(param_list, async_op=False, hierarchy=None)``."""
    groups = None
    with guard(NAME):
        params, async_op, hierarchy = _bind(*args, **kwargs)
        if not async_op and isinstance(params, (list, tuple)) and is_active(NAME) \
                and getattr(instance, "num_partitions", 1) > 1:  # DeepSpeed passes lists
            groups = _by_dtype(params)
            if groups is not None:
                stats["regrouped"] += 1
                _log.acted(NAME, "a blocking ZeRO-3 gather of parameters of several dtypes (%s) runs once per dtype",
                           "DeepSpeed < 0.19.3 gives every buffer the first parameter's dtype (#8072)",
                           ", ".join(str(g[0].ds_tensor.dtype).replace("torch.", "") for g in groups))
    if groups is None:
        return wrapped(*args, **kwargs)
    for group in groups:
        wrapped(group, async_op=False, hierarchy=hierarchy)
    return None


def patch_partition_parameters(module, patcher: Patcher) -> None:
    cls = require_attr(module, "Init")
    require_params(require_attr(cls, "_all_gather"), "param_list", "async_op", "hierarchy")
    patcher.wrap(cls, "_all_gather", _all_gather)


PATCH = Patch(
    changes=('error', 'collectives'),
    name=NAME,
    summary="ZeRO-3 + bf16 + peft LoRA (fp32 adapters) on a zero.Init model: TypeError: output tensor must have "
            "the same type as input tensor at the first optimizer step",
    signatures=((r"output tensor must have the same type as input tensor", r"_allgather_params_coalesced"),
                (r"ProcessGroupGloo::allgather: invalid tensor type", r"_allgather_params_coalesced")),
    versions_note="reached through peft LoRA on 0.19.2",
    affects={"deepspeed": "<0.19.3"},
    fingerprint=Fingerprint("deepspeed.runtime.zero.partition_parameters", r"dtype=param_list\[0\]\.ds_tensor\.dtype",
                            "the first parameter's dtype for every buffer of _allgather_params_coalesced (#8073)"),
    targets={"deepspeed.runtime.zero.partition_parameters": patch_partition_parameters},
)
