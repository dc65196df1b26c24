"""Let DeepSpeed's ``BF16_Optimizer`` take a step whose gradients are all zero, and skip one whose gradient norm is
not finite, as DeepSpeed 0.19.8 does, instead of stopping at a bare ``assert all_groups_norm > 0.``.

Symptom
    A bf16 run on DeepSpeed's ``BF16_Optimizer`` stops with a bare ``AssertionError`` at ``assert all_groups_norm >
    0.`` in ``bf16_optimizer.py`` (DeepSpeed #5223, "around a few hundred steps the training crashes";
    LLaMA-Factory #9298; Megatron-DeepSpeed #203):

    * at a step whose gradients are all exactly zero, which is a legitimate step: a micro-batch whose labels are
      all masked, a loss multiplied by zero, a model whose trainable part gets no gradient at that step;
    * at a step whose gradients hold inf or NaN (the norm helpers report those as -1).

    ``BF16_Optimizer`` is what DeepSpeed builds for bf16 with ZeRO stage 1 and ``data_types.grad_accum_dtype``
    fp32, for bf16 without ZeRO where gradients accumulate in fp32 (DeepSpeed's default before 0.17.6, so
    LLaMA-Factory's ZeRO-0 config), and for bf16 pipeline parallelism, on every release but 0.17.6-0.18.4 (whose
    ``BFLOAT16`` and ``DDP_BFLOAT16`` are the same string, so they build their fp16 wrapper;
    ``bf16_zero1_last_microbatch`` covers another bug of it on 0.18.5-0.18.x).

Cause
    ``BF16_Optimizer.step`` asserts ``all_groups_norm > 0.`` before clipping.  That guards clipping from the -1
    sentinel, but also refuses a norm of 0.  DeepSpeed 0.19.8 replaces it: a norm that is not finite or negative
    marks the step as overflowed, clears the gradients and returns (the engine counts it in ``skipped_steps``, the
    norm is reported as inf); a zero norm steps normally (clipping from it does nothing).

Affected versions
    DeepSpeed < 0.19.8, read from the released sdists: the assert is in 0.12.3, 0.14.1, 0.16.9, 0.18.5, 0.19.5 and
    0.19.7 (the source fingerprint); 0.19.8 has the new test.  Reproduced on CPU (gloo, 2 ranks) on 0.16.9 and
    0.19.2: both cases stop; 0.19.8 steps and skips.

Flag
    ``ZEROSHIM_BF16_NORM_ASSERT=auto|on|off`` (default ``auto``).

Fix
    ``BF16_Optimizer.step`` is wrapped.  Where it stops at that assert (nothing has been changed yet but the
    recorded norm) with a norm of exactly 0, the step is run again with the norm computation returning 1e-12 in
    place of 0 (its square stays above 0 in float32, where the MoE path squares the group norms), so the assert
    passes and clipping does nothing, as from 0 in 0.19.8; the recorded norm is then set back to 0.  (The norm
    function is swapped in the module for that call: a ``BF16_Optimizer`` stepping at the same time in another
    thread would see 1e-12 for a zero norm too.)  With a norm below 0 or not finite, the step is skipped as 0.19.8
    does: ``overflow`` set, the gradients cleared, the norm inf, and a WARNING on global rank 0 at each skip.
    ``overflow`` is set to False when the optimizer is built and at every step, as 0.19.8 does (accelerate decides
    when it wraps the optimizer whether to read it).  Every other ``AssertionError`` is left as it is.  What it
    changes: a run that would have stopped goes on, with 0.19.8's numbers (the zero step taken: weight decay and
    momentum move the weights; the non-finite step skipped).  A run that never meets the assert is not touched.

Undo
    ``zeroshim.unpatch("bf16_norm_assert")`` restores ``step`` and ``__init__``.

Evidence
    benchmarks/RESULTS.md, ``bf16_norm_assert``.
"""

from __future__ import annotations

import math
import os
import sys
import traceback

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "bf16_norm_assert"
#: stepped: zero-norm steps taken; skipped: non-finite-norm steps skipped
stats = {"stepped": 0, "skipped": 0}
MODULE = "deepspeed.runtime.bf16_optimizer"
NORM_FUNCTION = "get_global_norm_of_tensors"


def from_the_norm_assert(exc: BaseException) -> bool:
    """Was ``exc`` raised by ``BF16_Optimizer.step``'s ``assert all_groups_norm > 0.``?"""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    return (type(exc) is AssertionError and os.path.basename(last.filename) == "bf16_optimizer.py"
            and last.name == "step" and "all_groups_norm > 0" in (last.line or ""))


def _value(norm) -> float:
    try:
        return float(norm)
    except (TypeError, ValueError, RuntimeError):
        return math.nan


def _step(wrapped, instance, args, kwargs):
    """Wraps ``BF16_Optimizer.step(closure=None)``."""
    active = False
    with guard(NAME):
        active = is_active(NAME)
        if active:
            instance.overflow = False  # as 0.19.8 at every step; the engine reads it after the step
    try:
        return wrapped(*args, **kwargs)
    except AssertionError as exc:
        if not active or not from_the_norm_assert(exc):
            raise
        norm = _value(getattr(instance, "_global_grad_norm", None))
        if norm == 0.0:
            return _step_at_zero(wrapped, instance, args, kwargs)
        if norm < 0 or not math.isfinite(norm):
            return _skip(instance, norm)
        raise


#: what the norm computation gives for 0 in the step run again: clipping from it does nothing (as from 0), and
#: its square (the MoE path combines squared group norms in float32) is not 0
STAND_IN = 1e-12


def _step_at_zero(wrapped, instance, args, kwargs):
    """Run the step again with the norm computation giving :data:`STAND_IN` for 0."""
    import torch

    module = sys.modules[MODULE]
    original = getattr(module, NORM_FUNCTION)

    def at_least_tiny(*a, **k):
        norm = original(*a, **k)
        if torch.is_tensor(norm):
            return torch.where(norm == 0, torch.full_like(norm, STAND_IN), norm)
        return norm if norm != 0 else STAND_IN

    setattr(module, NORM_FUNCTION, at_least_tiny)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        setattr(module, NORM_FUNCTION, original)
    norm = instance._global_grad_norm
    instance._global_grad_norm = torch.zeros_like(norm) if torch.is_tensor(norm) else 0.0
    with guard(NAME):
        stats["stepped"] += 1
        _log.acted(NAME, "took a bf16 optimizer step whose gradients are all zero, as DeepSpeed 0.19.8 does",
                   "DeepSpeed %s stops there with a bare AssertionError (assert all_groups_norm > 0.)",
                   _versions.shown("deepspeed"))
    return result


def _skip(instance, norm: float):
    """Skip the step as 0.19.8 does for a norm that is not finite (the helpers' -1)."""
    instance.overflow = True
    instance._global_grad_norm = float("inf")
    for clear in ("clear_hp_grads", "clear_lp_grads"):
        getattr(instance, clear)()
    with guard(NAME):
        stats["skipped"] += 1
        _log.acted(NAME, "skipped bf16 optimizer steps whose gradient norm is not finite, as DeepSpeed 0.19.8 does",
                   "DeepSpeed %s stops there with a bare AssertionError", _versions.shown("deepspeed"))
        # every rank skips the same step (the norm is over all-reduced gradients): said on global rank 0
        _log.warning("zeroshim[%s]: skipped this optimizer step (%d so far in this process): the gradients hold inf "
                     "or NaN (norm %s), so the weights and the learning-rate schedule were not updated.", NAME,
                     stats["skipped"], norm, scope=_log.RANK0)
    return None


def _init(wrapped, instance, args, kwargs):
    """Wraps ``BF16_Optimizer.__init__``: ``overflow`` exists from the start, as in 0.19.8."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        if is_active(NAME) and not hasattr(instance, "overflow"):
            instance.overflow = False
    return result


def patch_bf16_optimizer(module, patcher: Patcher) -> None:
    cls = require_attr(module, "BF16_Optimizer")
    require_attr(cls, "step")
    require_attr(cls, "__init__")
    require_attr(cls, "clear_hp_grads")
    require_attr(cls, "clear_lp_grads")
    require_attr(module, NORM_FUNCTION)
    patcher.wrap(cls, "step", _step)
    patcher.wrap(cls, "__init__", _init)


PATCH = Patch(
    changes=("error",),  # a run that would have stopped goes on, with DeepSpeed 0.19.8's numbers
    name=NAME,
    summary="bf16 on DeepSpeed's BF16_Optimizer (ZeRO-1 with fp32 gradient accumulation, bf16 without ZeRO before "
            "0.17.6) stops with a bare AssertionError at \"assert all_groups_norm > 0.\" at a step whose gradients "
            "are all zero, or not finite",
    # the assert's line in the traceback, and the bare AssertionError after it
    signatures=((r"assert all_groups_norm > 0\.", r"(?m)^\s*AssertionError\s*$"),),
    affects={"deepspeed": "<0.19.8"},
    fingerprint=Fingerprint(MODULE, r"assert all_groups_norm > 0\.",
                            "BF16_Optimizer.step's assert on the gradient norm (0.19.8 tests is_invalid_grad_norm)"),
    targets={MODULE: patch_bf16_optimizer},
)
