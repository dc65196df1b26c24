"""Sum every micro-batch's gradient under ZeRO-2 with gradient accumulation (DeepSpeed 0.17.6-0.18.2).

Symptom
    Nothing fails.  ZeRO stage 2 without optimizer offload and with ``gradient_accumulation_steps`` above 1 steps
    with the gradient of the last micro-batch of each accumulation only, divided by the number of micro-batches:
    the earlier ones are dropped, the reported gradient norm is smaller than ZeRO-1's or ZeRO-3's for the same run,
    and the model trains to other numbers than on any other stage or release (DeepSpeed #7718, "Incorrect gradient
    computation in ZeRO-2 with DeepSpeed >= 0.17.6"; TRL #4540 and accelerate #3877 report the same divergence).
    Every ZeRO-2 run with accumulation on those releases, the HF Trainer's, TRL's and LLaMA-Factory's included.  So
    does DeepSpeed's own way to accumulate by hand with ``gradient_accumulation_steps`` 1,
    ``engine.set_gradient_accumulation_boundary(False)`` before every backward but the last (#1588; the ZeRO-2 +
    offload form of it is ``zero_manual_accumulation``'s).

Cause
    ZeRO-2 reduces each micro-batch's gradients as they are formed and hands them to
    ``independent_gradient_partition_epilogue`` after every backward.  The Muon support (#7509, first released in
    0.17.6) moved the accumulation into a new ``all_grad_tensors``, but kept the old test for the first micro-batch
    of an accumulation: ``if not i in self.averaged_gradients or self.averaged_gradients[i] is None``, which holds
    at every micro-batch before the boundary (``averaged_gradients`` is filled only there), so each micro-batch
    replaces what the earlier ones left.  ZeRO-1 reduces only at the boundary and is not affected.  0.18.3 (#7665)
    tests ``all_grad_tensors`` instead and adds each micro-batch to it.

Affected versions
    DeepSpeed >= 0.17.6, < 0.18.3, read at the tags v0.17.5, v0.17.6, v0.18.0, v0.18.2 and v0.18.3: that test before
    ``self.all_grad_tensors[i] = self.get_all_grad_tensors(...)`` is the source fingerprint (0.17.5 accumulated in
    ``averaged_gradients``; 0.18.3 tests ``all_grad_tensors``).  Reproduced on CPU, 2 ranks, fp32: on 0.18.2 ZeRO-2
    with 4 micro-batches per step trains otherwise than ZeRO-0 and ZeRO-1 (gradient norm 0.48 against 0.77 at the
    first step); on 0.18.5 the three are equal bit for bit where every sum is exact.

Flag
    ``ZEROSHIM_ZERO2_ACCUMULATION_OVERWRITE=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedZeroOptimizer.get_all_grad_tensors`` is wrapped: where the epilogue asks it for a group's gradients
    to replace ``all_grad_tensors`` although that group holds the gradients of earlier micro-batches of the same
    accumulation (``averaged_gradients`` not yet filled), the new gradients are added to those and they are
    returned, so the epilogue keeps the sum, as 0.18.3 does (the same ``add_``, in the same order), up to and with
    the boundary's micro-batch, with ``gradient_accumulation_steps`` above 1 or backward calls marked as not the
    boundary.  The first micro-batch of each accumulation (nothing earlier to add to), offload, and several
    boundary backward calls before one step (``zero_manual_accumulation``'s) are left as they are.  It changes the numbers of every such run (all micro-batches count): said once per job at WARNING.
    Ranks that disagree stop.

Undo
    ``zeroshim.unpatch("zero2_accumulation_overwrite")`` restores ``get_all_grad_tensors``.

Evidence
    benchmarks/RESULTS.md, ``zero2_accumulation_overwrite``.
"""

from __future__ import annotations

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "zero2_accumulation_overwrite"
#: accumulated: (epilogue call, parameter group) pairs whose micro-batch was added to the earlier ones instead of
#: replacing them
stats = {"accumulated": 0}


def _pending(optimizer, tensor_list):
    """The gradients of the earlier micro-batches of this accumulation for the group whose partition is
    ``tensor_list``, where the epilogue is about to replace them (its first branch); else None."""
    groups = getattr(optimizer, "params_in_partition", None) or []
    index = next((i for i, params in enumerate(groups) if params is tensor_list), None)
    if index is None or getattr(optimizer, "cpu_offload", False):
        return None
    averaged = getattr(optimizer, "averaged_gradients", {})
    if index in averaged and averaged[index] is not None:
        return None  # the epilogue's own accumulate branch
    return getattr(optimizer, "all_grad_tensors", {}).get(index)


def _get_all_grad_tensors(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer.get_all_grad_tensors(tensor_list, dtype)``."""
    earlier = None
    with guard(NAME):
        tensor_list = args[0] if args else kwargs.get("tensor_list")
        if is_active(NAME):
            earlier = _pending(instance, tensor_list)
    new = wrapped(*args, **kwargs)
    if earlier is None:
        return new
    for accumulated, grad in zip(earlier, new):
        accumulated.add_(grad)
    with guard(NAME):
        stats["accumulated"] += 1
        _log.acted(NAME, "added each micro-batch's ZeRO-2 gradients to the earlier ones of the accumulation, as "
                         "DeepSpeed 0.18.3 does", "DeepSpeed %s replaces them, so only the last micro-batch of each "
                   "step counts", _versions.shown("deepspeed"))
    return earlier


def patch_stage_1_and_2(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedZeroOptimizer")
    require_params(cls.get_all_grad_tensors, "tensor_list", "dtype")
    require_attr(cls, "independent_gradient_partition_epilogue")
    patcher.wrap(cls, "get_all_grad_tensors", _get_all_grad_tensors)


PATCH = Patch(
    changes=("numbers",),
    on_disagreement="stop",  # without it a rank steps with its last micro-batch only
    name=NAME,
    summary="ZeRO-2 with gradient_accumulation_steps above 1: only the last micro-batch of each step counts, the "
            "others are dropped (silent)",
    signatures=(),
    affects={"deepspeed": ">=0.17.6,<0.18.3"},
    fingerprint=Fingerprint("deepspeed.runtime.zero.stage_1_and_2",
                            r"if not i in self\.averaged_gradients or self\.averaged_gradients\[i\] is None:\s*"
                            r"self\.all_grad_tensors\[i\] = self\.get_all_grad_tensors\(",
                            "the epilogue replacing all_grad_tensors while averaged_gradients is empty"),
    targets={"deepspeed.runtime.zero.stage_1_and_2": patch_stage_1_and_2},
)
