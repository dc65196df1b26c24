"""All-reduce ZeRO-1/2's gradients on DeepSpeed's CPU accelerator with ``contiguous_gradients: false``, as DeepSpeed
0.19.8 does.

Symptom
    Nothing fails.  ZeRO stage 1 or 2 with ``"contiguous_gradients": false`` on DeepSpeed's CPU accelerator (CPU
    training, with or without Intel's extension) never averages the gradients over the ranks: each rank steps its
    partition with its own rank's gradient, and the gathered model is a patchwork of what each rank saw alone.
    Measured on DeepSpeed 0.19.2, 2 ranks, each its own data, fp32 SGD: the parameters differ from the
    single-process run on the averaged gradient, which ``contiguous_gradients: true`` matches bit for bit.

Cause
    ``deepspeed/runtime/zero/stage_1_and_2.py``: without contiguous gradients, ``reduce_ipg_grads`` reduces through
    ``buffered_reduce_fallback``, which sorts the gradients into buckets with ``split_half_float_double``.  That
    compares ``tensor.type()`` with ``"torch.{device}.FloatTensor"`` (and the half, double and bf16 names) built from
    the accelerator's device name.  A CPU tensor's type is ``"torch.FloatTensor"``, without a device, so on the CPU
    accelerator no gradient lands in a bucket and no all-reduce runs.  DeepSpeed 0.19.8 compares dtypes instead.
    CUDA and other accelerators' tensors carry their device in the name and are not affected.

Affected versions
    DeepSpeed < 0.19.8 on the CPU accelerator, read from the released sdists: 0.14.1, 0.16.9, 0.19.2 and 0.19.7 build
    the names from ``get_accelerator().device_name()`` (the source fingerprint); 0.19.8 compares ``tensor.dtype``.
    ZeRO-1/2 with CPU offload forces contiguous gradients and is not affected.

Flag
    ``ZEROSHIM_ZERO_CPU_UNREDUCED_GRADS=auto|on|off`` (default ``auto``).

Fix
    ``split_half_float_double`` is wrapped: on the CPU accelerator, where the original leaves out a dense half,
    float, double or bf16 tensor, its buckets are replaced by 0.19.8's (one per dtype, in the same order: half,
    float, double, bf16), so DeepSpeed's own all-reduce runs on them.  On other accelerators nothing changes.
    ZeRO-1 with MoE layers (which ZeRO-2 refuses without contiguous gradients) then all-reduces the expert
    gradients over the whole data-parallel group, as this path does on CUDA and on 0.19.8: DeepSpeed's own
    behaviour, now on the CPU too.  Every
    rank decides the same way (the same accelerator and gradient dtypes) and the decision is also checked across
    the ranks at startup (``on_disagreement="stop"``).  It changes the numbers of such runs (each rank now steps
    with the average over the ranks, as with contiguous gradients) and adds the all-reduces that were missing: said
    once per job at WARNING.

Undo
    ``zeroshim.unpatch("zero_cpu_unreduced_grads")`` restores ``split_half_float_double``.

Evidence
    benchmarks/RESULTS.md, ``zero_cpu_unreduced_grads``.
"""

from __future__ import annotations

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "zero_cpu_unreduced_grads"
#: recovered: calls whose buckets the original left short; tensors: the gradients it had left out
stats = {"recovered": 0, "tensors": 0}


def _by_dtype(tensors) -> list:
    """DeepSpeed 0.19.8's buckets: the dense tensors of each of half, float, double and bf16, in that order."""
    import torch

    out = []
    for dtype in (torch.half, torch.float, torch.double, torch.bfloat16):
        bucket = [t for t in tensors if t.dtype == dtype and t.layout == torch.strided]
        if bucket:
            out.append(bucket)
    return out


def _on_cpu() -> bool:
    """DeepSpeed's accelerator is the CPU (elsewhere the type names carry the device and match: a tensor the
    original leaves out there is on another device, and stays out)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def _split(wrapped, instance, args, kwargs):
    """Wraps ``split_half_float_double(tensors)``."""
    tensors = args[0] if args else kwargs.get("tensors")
    if isinstance(tensors, list):
        buckets = wrapped(*args, **kwargs)
    else:  # an iterable read once: the original iterates it once per dtype
        tensors = list(tensors)
        buckets = wrapped(tensors, *args[1:], **kwargs)
    with guard(NAME):
        if is_active(NAME) and _on_cpu():
            kept = sum(len(bucket) for bucket in buckets)
            fixed = _by_dtype(tensors)
            missing = sum(len(bucket) for bucket in fixed) - kept
            if missing > 0:
                stats["recovered"] += 1
                stats["tensors"] += missing
                _log.acted(NAME, "all-reduced %d ZeRO-1/2 gradient(s) over the ranks that DeepSpeed's bucketing left "
                                 "out, as DeepSpeed 0.19.8 does", "DeepSpeed %s (contiguous_gradients false) matches "
                           "gradients by the type name \"torch.<device>.FloatTensor\", which a CPU tensor does not "
                           "have, so each rank stepped with its own gradient", missing, _versions.shown("deepspeed"))
                return fixed
    return buckets


def patch_stage_1_and_2(module, patcher: Patcher) -> None:
    require_params(require_attr(module, "split_half_float_double"), "tensors")
    patcher.wrap(module, "split_half_float_double", _split)


PATCH = Patch(
    changes=("numbers", "collectives"),
    on_disagreement="stop",  # a rank left unpatched would skip the all-reduces the others run: a hang
    name=NAME,
    summary="ZeRO-1/2 on DeepSpeed's CPU accelerator with contiguous_gradients false: the gradients are never "
            "all-reduced, each rank steps with its own (silent)",
    signatures=(),
    versions_note="on the CPU accelerator, contiguous_gradients false; CUDA untouched",
    affects={"deepspeed": "<0.19.8"},
    fingerprint=Fingerprint("deepspeed.runtime.zero.stage_1_and_2",
                            r'"torch\.\{\}\.FloatTensor"\.format\(device_type\)',
                            "split_half_float_double matching gradients by \"torch.<device>.FloatTensor\" (0.19.8 "
                            "compares dtypes)"),
    targets={"deepspeed.runtime.zero.stage_1_and_2": patch_stage_1_and_2},
)
