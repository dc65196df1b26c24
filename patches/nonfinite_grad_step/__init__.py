"""Skip a ZeRO optimizer step whose gradient norm is not finite, instead of writing inf or NaN into the weights and
reporting the norm as 1.0, as DeepSpeed 0.19.8 does.

Symptom
    One micro-batch with an inf or NaN gradient (a loss spike, a bad sample, an overflow in a bf16 kernel) ends the
    run's usefulness without a word.  Under ZeRO stage 3 in bf16 or fp32, and stage 1 or 2 in fp32, DeepSpeed applies
    that step: the weights (and Adam's moments) become NaN or inf, every later loss is nan, and the gradient norm
    DeepSpeed reports for the step (``engine.get_global_grad_norm()``, the HF Trainer's ``grad_norm``) is 1.0, a
    healthy-looking number (with several parameter groups, the L2 norm of the others and 1; nan on 0.14.1, whose
    mask keeps a NaN).  Nothing is logged and ``skipped_steps`` stays 0.  With the optimizer offloaded to the CPU,
    ZeRO-1/2 on DeepSpeed 0.14.1-0.17.0 stops instead where every group's norm is invalid (one group: the usual
    case): its offload norm returns the -1 as an int, and the L2 norm of the groups fails ("linalg.vector_norm:
    Expected a floating point or complex tensor as input").  Under stage 1 or 2 in bf16 without ``bf16.check_grad_overflow`` (DeepSpeed's
    default before 0.19.3; the setting exists from 0.17.1) the step is applied in 0.19.8 too, but reported there as
    inf.  fp16 checks its gradients for overflow itself: not affected.

Cause
    ``get_grad_norm_direct`` (and ZeRO-1/2's CPU-offload norm) replaces an inf or NaN group norm by -1, and the
    step combines the group norms with an L2 norm, which squares that -1 to 1.0: the step then clips by a finite
    norm and applies the non-finite gradients.  Only fp16 (and bf16 ZeRO-1/2 with the overflow check on) looks at
    the gradients before.  DeepSpeed 0.19.8 keeps the -1 invalid (``combine_grad_norm_groups``) and skips the step
    where ``is_invalid_grad_norm``: ZeRO-3 for every dtype, ZeRO-1/2 unless bf16 runs without the overflow check;
    the skip is said ("OVERFLOW! Skipping step") and the norm reported as inf.

Affected versions
    DeepSpeed < 0.19.8, read from the released sdists: ZeRO-3's ``step`` takes the L2 norm of the group norms after
    ``_overflow_check_and_loss_scale_update``, which checks only fp16, in 0.12.3, 0.14.1, 0.16.9, 0.18.5, 0.19.5
    and 0.19.7; ZeRO-1/2's ``scaled_global_norm`` does the same after the fp16 (later: ``check_grad_overflow``)
    check.  0.19.8 has ``is_invalid_grad_norm`` in ``stage3.py`` (the source fingerprint: the bug where it is
    absent).

Flag
    ``ZEROSHIM_NONFINITE_GRAD_STEP=auto|on|off`` (default ``auto``).

Fix
    Where the step would be applied with a norm that is not finite (-1, inf or NaN in any group), zeroshim makes
    DeepSpeed take the path it takes for an fp16 overflow: the gradients are cleared, the weights, the moments and
    the learning-rate schedule stay, the engine counts the step in ``skipped_steps``, and the norm is reported as
    inf; on global rank 0, a WARNING at each skipped step.  That is ZeRO-3's ``_overflow_check_and_loss_scale_update``
    (the group norms are computed there, just before the step would compute them, and the step uses those) and
    ZeRO-1/2's ``step`` (the norm is computed at its start and used by the step; ``_update_scale`` gets the
    overflow; where the norm itself fails on the offload helper's integer -1, the step is skipped the same way).
    Every rank takes the same decision: the norm is all-reduced.  Where 0.19.8 applies the step too
    (bf16 ZeRO-1/2 without the overflow check), the run trains as without zeroshim; the norm is reported as inf
    and a WARNING, once, says the weights now hold inf or NaN and names the setting that skips such steps (0.19.8
    clips that step by the inf norm, which zeroes its finite entries; here DeepSpeed clips it as it would have:
    the weights hold NaN either way).
    ``overflow`` is reset at each step's start, as in 0.19.8 (DeepSpeed < 0.19.8 never set it outside fp16 and the
    bf16 check), and a checkpoint saved right after a skipped step stores it as False, so that a resume without
    zeroshim does not skip every step; ``zeroshim.unpatch`` puts ``overflow`` right on an optimizer whose last step
    it skipped.  Not touched: fp16 (its own overflow check and loss scale; 0.19.8 also skips an fp16 step whose
    norm alone is invalid, which its overflow check leaves practically unreachable), a step run through torch's
    ``GradScaler`` (``torch_autocast``), ``zero_optimization.compute_grad_norm`` false (0.19.7: no norm, and 0.19.8
    tests none), ZenFlow's ZeRO-1/2 optimizer (its own ``step``; 0.19.8 skips there too: not covered),
    ``BF16_Optimizer`` (patch ``bf16_norm_assert``), and bf16 without ZeRO on 0.17.6-0.18.5 (DeepSpeed's fp16
    wrappers, which 0.19.8 also changed: not covered).

Undo
    ``zeroshim.unpatch("nonfinite_grad_step")`` restores the methods, and resets ``overflow`` on an optimizer whose
    last step it skipped.

Evidence
    benchmarks/RESULTS.md, ``nonfinite_grad_step``.
"""

from __future__ import annotations

import math
import weakref

from zeroshim import _flags, _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr
from zeroshim._source import Fingerprint
from zeroshim._timing import original_work

NAME = "nonfinite_grad_step"
#: skipped: steps skipped; written: steps applied with a non-finite norm (bf16 ZeRO-1/2 without the check)
stats = {"skipped": 0, "written": 0}
STAGE_1_AND_2 = "deepspeed.runtime.zero.stage_1_and_2"
STAGE_3 = "deepspeed.runtime.zero.stage3"
#: the L2 norm of the groups failing on the offload helper's integer -1 (DeepSpeed 0.14.1-0.17.0)
INT_NORM = "Expected a floating point or complex tensor"
#: on the optimizer: the patch that decided its last skip (patch ``silent_overflow_skip`` leaves that one unsaid)
SKIPPED_BY = "_zeroshim_skipped_by"
#: on the optimizer during a step: the :class:`_Plan`
PLAN = "_zeroshim_nonfinite_plan"


class _Plan:
    """What one step does: ``norm`` the step's own norm (ZeRO-1/2: the combined one; ZeRO-3: the group list),
    ``pending`` until the step has used it; ``seen`` the group norms collected while it was computed; ``skip``
    where the norm is not finite and 0.19.8 skips; ``written`` where it is not finite and the step is applied;
    ``ours`` where this patch made the step skip."""

    __slots__ = ("norm", "pending", "seen", "skip", "written", "ours", "reported")

    def __init__(self):
        self.norm, self.pending, self.seen = None, False, []
        self.skip = self.written = self.ours = False
        self.reported = "?"  # what DeepSpeed would have reported as the step's norm (or how it would have failed)


def _bad(value: float) -> bool:
    return not math.isfinite(value) or value < 0


def invalid(norms) -> bool:
    """DeepSpeed 0.19.8's ``is_invalid_grad_norm`` over ``norms`` (tensors or numbers): one not finite, or the
    helpers' -1.  Numbers and one-element CPU tensors are read one by one (a torch reduction costs more: about
    180 us a step beside the training's own ops, measured); the other tensors are tested together (one host
    synchronisation, as 0.19.8's test)."""
    import torch

    tensors = []
    for n in norms:
        if not torch.is_tensor(n):
            if _bad(float(n)):
                return True
        elif n.device.type == "cpu" and n.numel() == 1:
            if _bad(float(n)):
                return True
        else:
            tensors.append(n.detach().reshape(-1).float())
    if not tensors:
        return False
    if len({t.device for t in tensors}) > 1:
        tensors = [t.cpu() for t in tensors]
    joined = torch.cat(tensors)
    return bool((~torch.isfinite(joined) | (joined < 0)).any())


def acts_on(optimizer) -> bool:
    """Not fp16 (its own overflow check and loss scale), not under torch's GradScaler."""
    import torch

    return getattr(optimizer, "dtype", None) != torch.float16 \
        and getattr(optimizer, "torch_autocast_gradscaler", None) is None


#: optimizers whose last step this patch skipped (``overflow`` still True): put right at :func:`_undo`
_pending = weakref.WeakSet()


def _undo() -> None:
    """``zeroshim.unpatch``: an optimizer whose last step this patch skipped keeps ``overflow`` True, which
    DeepSpeed < 0.19.8 never resets outside fp16 (and the bf16 check): every later step would be skipped."""
    for optimizer in list(_pending):
        if vars(optimizer).pop(SKIPPED_BY, None) == NAME:
            optimizer.overflow = False
    _pending.clear()


def _begin(optimizer) -> bool:
    """At a step's start: reset ``overflow`` (as 0.19.8); whether the patch acts on this step."""
    active = False
    with guard(NAME):
        active = is_active(NAME) and acts_on(optimizer)
        optimizer.__dict__.pop(PLAN, None)
        if optimizer.__dict__.pop(SKIPPED_BY, None) is not None or active:
            optimizer.overflow = False
        _pending.discard(optimizer)
    return active


# ZeRO-1/2 ------------------------------------------------------------------------------------------------------

def _step12(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer.step()``: the norm first, then the step with it."""
    # zero_optimization.compute_grad_norm false (0.19.7): the step computes no norm, and 0.19.8 neither tests nor
    # skips: left as it is
    if not _begin(instance) or getattr(instance, "compute_grad_norm", True) is False:
        return wrapped(*args, **kwargs)
    plan = _Plan()
    instance.__dict__[PLAN] = plan
    try:
        # DeepSpeed's own norm (its collectives, its errors), which the step below gets back instead of computing
        # it again: nothing that runs in between touches the gradients it reads
        try:
            with original_work():  # DeepSpeed's norm, moved, not zeroshim's time (benchmark mode only)
                plan.norm = instance.scaled_global_norm()
            plan.pending = True
        except RuntimeError as error:
            # DeepSpeed 0.14.1-0.17.0's CPU-offload helper returns its -1 as an int, and where every group's norm
            # is that int the L2 norm of the groups fails on an integer tensor (the same on every rank: the group
            # norms are all-reduced).  Where every group's norm was computed and one is invalid, the step is
            # skipped as 0.19.8 skips it; anything else is DeepSpeed's error.
            recognised = False
            with guard(NAME):
                recognised = INT_NORM in str(error) and len(plan.seen) == len(instance.bit16_groups) \
                    and _skips(instance) and invalid(plan.seen)
            if not recognised:
                raise
            plan.skip, plan.reported = True, "a RuntimeError (the norm of an integer -1)"
        with guard(NAME):
            if plan.pending and invalid([plan.norm, *plan.seen]):
                plan.skip, plan.written = _skips(instance), not _skips(instance)
                plan.reported = _shown(plan.norm)
        result = wrapped(*args, **kwargs)
    finally:
        instance.__dict__.pop(PLAN, None)
    with guard(NAME):
        if plan.ours:
            _skipped(instance, plan)
        elif plan.written:
            _written(instance, plan)
    return result


def _skips(optimizer) -> bool:
    """Whether 0.19.8 skips a ZeRO-1/2 step whose norm is not finite: unless bf16 runs without the overflow
    check."""
    import torch

    return not (optimizer.dtype == torch.bfloat16 and not getattr(optimizer, "check_grad_overflow", False))


def _collect(wrapped, instance, args, kwargs):
    """Wraps ZeRO-1/2's per-group norm helpers: while the plan's norm is computed, keep what each returns (the
    combined norm hides their -1)."""
    norm = wrapped(*args, **kwargs)
    plan = instance.__dict__.get(PLAN)
    if plan is not None and not plan.pending:
        plan.seen.append(norm)
    return norm


def _stashed_norm(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer.scaled_global_norm`` and ``DeepSpeedZeroOptimizer_Stage3._get_norm_groups``:
    the step gets back the norm computed just before (its plan is done with)."""
    plan = instance.__dict__.get(PLAN)
    if plan is not None and plan.pending and not args and not kwargs:
        plan.pending = False
        instance.__dict__.pop(PLAN, None)
        return plan.norm
    return wrapped(*args, **kwargs)


def _update_scale12(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer._update_scale(has_overflow)``, called once by the step after its overflow
    check: where that found nothing and the norm is not finite, the step takes its overflow path."""
    plan = instance.__dict__.get(PLAN)
    if plan is not None and plan.skip:
        with guard(NAME):
            has_overflow = args[0] if args else kwargs.get("has_overflow", False)
            if not has_overflow:
                instance.overflow = True
                instance.__dict__[SKIPPED_BY] = NAME  # before the step returns (other wrappers of it read it)
                _pending.add(instance)
                plan.ours = True
                args, kwargs = (True,), {}
    return wrapped(*args, **kwargs)


# ZeRO-3 --------------------------------------------------------------------------------------------------------

def _overflow_check3(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer_Stage3._overflow_check_and_loss_scale_update()``, which the step calls right
    before it computes the group norms: they are computed here, and the step gets them back."""
    if not _begin(instance):
        return wrapped(*args, **kwargs)
    plan = _Plan()
    instance.__dict__[PLAN] = plan
    try:
        with original_work():  # DeepSpeed's own norms (moved, not zeroshim's time), its collectives and errors
            plan.norm = instance._get_norm_groups()
        plan.pending = True
        with guard(NAME):
            if invalid(list(plan.norm)):
                plan.reported = _shown(_l2(plan.norm))
                instance.overflow = True  # its fp16-only check leaves it alone: _update_scale and the clean-up follow
                instance.__dict__[SKIPPED_BY] = NAME
                _pending.add(instance)
                plan.skip = plan.ours = True
                plan.pending = False
        overflow = wrapped(*args, **kwargs)
    except BaseException:
        instance.__dict__.pop(PLAN, None)
        raise
    if overflow:  # the step returns: nothing takes the norms
        instance.__dict__.pop(PLAN, None)
    with guard(NAME):
        if plan.ours and overflow:
            _skipped(instance, plan)
    return overflow


# both ----------------------------------------------------------------------------------------------------------

def _state_dict(wrapped, instance, args, kwargs):
    """Wraps the optimizers' ``state_dict``: right after a skip of this patch's, ``overflow`` is stored as False
    (DeepSpeed < 0.19.8 reads it back and, outside fp16, never resets it: every later step would be skipped)."""
    state = wrapped(*args, **kwargs)
    with guard(NAME):
        if instance.__dict__.get(SKIPPED_BY) == NAME and isinstance(state, dict) and state.get("overflow") is True:
            state["overflow"] = False
    return state


def _l2(norms):
    """The groups' L2 norm as DeepSpeed < 0.19.8 takes it (the -1 squared to 1)."""
    import torch

    return torch.linalg.vector_norm(torch.stack([torch.as_tensor(n, dtype=torch.float).reshape(()).cpu()
                                                 for n in norms]))


def _shown(norm) -> str:
    try:
        return "%.6g" % float(norm)
    except (TypeError, ValueError, RuntimeError):
        return "?"


def _skipped(optimizer, plan) -> None:
    optimizer._global_grad_norm = float("inf")
    stats["skipped"] += 1
    _log.acted(NAME, "skipped optimizer steps whose gradient norm is not finite, as DeepSpeed 0.19.8 does",
               "DeepSpeed %s applies them, writing inf or NaN into the weights, and reports a finite norm (the -1 "
               "it masks an invalid group norm to, squared)", _versions.shown("deepspeed"))
    # every rank skips the same step (the norm is all-reduced): said on global rank 0
    _log.warning("zeroshim[%s]: skipped this optimizer step (%d so far in this process): the gradients hold inf or "
                 "NaN (the gradient norm is not finite), so the weights and the learning-rate schedule were not "
                 "updated, and the norm is reported as inf. Without zeroshim DeepSpeed %s would have applied it, "
                 "writing them into the weights, with the norm reported as %s (0.19.8 skips such steps). %s=off "
                 "turns this off.", NAME, stats["skipped"], _versions.shown("deepspeed"), plan.reported,
                 _flags.env_name(NAME), scope=_log.RANK0)


def _written(optimizer, plan) -> None:
    optimizer._global_grad_norm = float("inf")
    stats["written"] += 1
    ds = _versions.shown("deepspeed")
    remedy = ('set "bf16": {"check_grad_overflow": true} in the DeepSpeed config (DeepSpeed\'s default from 0.19.3)'
              if hasattr(optimizer, "check_grad_overflow") else
              'DeepSpeed >= 0.17.1 with "bf16": {"check_grad_overflow": true} (its default from 0.19.3)')
    _log.warning("zeroshim[%s]: this optimizer step was applied with gradients that hold inf or NaN: bf16 ZeRO-1/2 "
                 "does not check them without bf16.check_grad_overflow, so the weights now hold inf or NaN. The "
                 "norm is reported as inf (DeepSpeed %s reports %s). To skip such steps instead: %s. Said once; "
                 "later such steps are counted in zeroshim.stats(%r).", NAME, ds, plan.reported, remedy, NAME,
                 scope=_log.RANK0, once=(NAME, "written"))


def patch_stage_1_and_2(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedZeroOptimizer")
    for attr in ("step", "scaled_global_norm", "_update_scale", "get_grad_norm_direct",
                 "complete_grad_norm_calculation_for_cpu_offload", "state_dict"):
        require_attr(cls, attr)
    patcher.wrap(cls, "step", _step12)
    patcher.wrap(cls, "scaled_global_norm", _stashed_norm)
    patcher.wrap(cls, "_update_scale", _update_scale12)
    patcher.wrap(cls, "get_grad_norm_direct", _collect)
    patcher.wrap(cls, "complete_grad_norm_calculation_for_cpu_offload", _collect)
    patcher.wrap(cls, "state_dict", _state_dict)


def patch_stage3(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedZeroOptimizer_Stage3")
    for attr in ("_overflow_check_and_loss_scale_update", "_get_norm_groups", "state_dict"):
        require_attr(cls, attr)
    patcher.wrap(cls, "_overflow_check_and_loss_scale_update", _overflow_check3)
    patcher.wrap(cls, "_get_norm_groups", _stashed_norm)
    patcher.wrap(cls, "state_dict", _state_dict)


PATCH = Patch(
    # a step that would write inf/NaN into the weights is skipped (numbers), and with it the step's collectives
    changes=("numbers", "collectives"),
    # ranks that skip by different rules would update their partitions differently (or wait in the step's
    # all-gather for a rank that skipped): a split stops the run
    on_disagreement="stop",
    on_undo=_undo,
    name=NAME,
    summary="ZeRO-3 in bf16 or fp32, and ZeRO-1/2 in fp32, apply a step whose gradients hold inf or NaN: the "
            "weights become NaN, nothing is skipped or said, and the gradient norm is reported as 1.0 (nan on "
            "0.14.1) (silent)",
    signatures=(),
    affects={"deepspeed": "<0.19.8"},
    fingerprint=Fingerprint(STAGE_3, r"is_invalid_grad_norm\(",
                            "ZeRO-3's step testing the gradient norm with is_invalid_grad_norm (0.19.8)",
                            bug_when="absent"),
    targets={STAGE_1_AND_2: patch_stage_1_and_2, STAGE_3: patch_stage3},
)
