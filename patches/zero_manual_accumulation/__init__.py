"""Several ``engine.backward()`` calls before one ``engine.step()`` under ZeRO-1/2: keep every micro-batch's gradient.

Symptom
    A loop that accumulates by hand -- ``gradient_accumulation_steps: 1`` in
    the DeepSpeed config, ``engine.backward(loss_i)`` for K micro-batches,
    then one ``engine.step()`` (RL trainers, custom loops; allenai/open-instruct#1498)
    -- trains under ZeRO stage 1 or 2 on the gradient of the LAST micro-batch
    only: nothing fails, the earlier K-1 are silently dropped (2 ranks, K = 3,
    SGD lr 1 so the step is minus the gradient: least-squares coefficients of
    the step on the three micro-batch gradients are 0 / 0 / 1 on DeepSpeed
    0.19.2 and 0.19.8, 1 / 1 / 1 for stage 0 and ZeRO-3).  On DeepSpeed
    0.17.6 - 0.18.2 the second ``backward`` fails instead with
    ``TypeError: 'NoneType' object is not iterable`` in
    ``independent_gradient_partition_epilogue``.  With ``offload_optimizer``
    ZeRO-1/2 get it wrong on every release read: only the last micro-batch up
    to 0.18.x; from 0.19.0 every one but the first, plus the previous step's
    accumulated gradients leaking into the next step (measured: the second
    step is g2 + g3 of this step plus g2 + g3 of the step before).  And
    DeepSpeed's own way to accumulate by hand,
    ``engine.set_gradient_accumulation_boundary(False)`` before every backward
    but the last, keeps only the last micro-batch under ZeRO-2 +
    ``offload_optimizer`` before 0.19.0 (measured on 0.14.1 and 0.16.9; the
    case #7981 fixed), and under ZeRO-2 without offload on 0.17.6 - 0.18.2
    (patch ``zero2_accumulation_overwrite``'s, with the configured
    accumulation).

Cause
    With ``gradient_accumulation_steps`` 1 every ``backward`` is an
    accumulation boundary (``engine.is_gradient_accumulation_boundary()`` is
    ``(micro_steps + 1) % 1 == 0`` and ``micro_steps`` only moves in
    ``step()``).  Up to 0.17.5 ZeRO-1/2's
    ``independent_gradient_partition_epilogue`` added each backward's reduced
    partition to ``averaged_gradients``, which ``step()`` consumes, so K
    backward calls summed (as stage 0 and ZeRO-3 still do).  The Muon support
    (#7509, first released in 0.17.6) routed the accumulation through a new
    ``all_grad_tensors`` and made the boundary REPLACE ``averaged_gradients``
    (``self.averaged_gradients[i] = self.get_flat_partition(...)`` then
    ``self.all_grad_tensors[i] = None``); in 0.17.6 - 0.18.2 the next boundary
    takes the accumulate branch with ``all_grad_tensors[i]`` already ``None``
    (the ``TypeError``); 0.18.3 tests ``all_grad_tensors`` instead, so each
    boundary silently overwrites the last.  With ``offload_optimizer`` the
    partition is copied into the fp32 gradient buffer at every boundary
    (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``, a copy), and the CPU
    accumulator is used only when ``gradient_accumulation_steps > 1`` (up to
    0.18.x) or, since #7981 (0.19.0, written for the
    ``set_gradient_accumulation_boundary`` style), from the second backward
    of a step on -- never reset, since the first backward of a step skips it.
    DeepSpeed's own ways to accumulate by hand are
    ``engine.set_gradient_accumulation_boundary(False/True)`` around the
    backward calls (#1588) and, from 0.19.4, ``"managed_gradient_accumulation":
    false`` (#8184/#8203/#8217; with offload from 0.19.5, #8225), which is
    opt-in: the default (``true``) keeps the behaviour above.

Affected versions
    Every DeepSpeed release, in one form or another (the gate is any version;
    the patch reads the optimizer at run time).  Read from the released sdists
    and measured (2 ranks, fp32): ZeRO-1/2
    without offload: correct up to 0.17.5 (0.14.1, 0.16.9 measured; 0.17.5
    read), ``TypeError`` 0.17.6 - 0.18.2 (0.17.6 and 0.18.2 read, 0.18.0 run
    from its sdist), silently wrong from 0.18.3 (read) through 0.19.8
    (0.19.2, 0.19.8 measured; 0.19.3/0.19.4/0.19.5 read: the overwrite is
    unchanged in the default managed mode).  ZeRO-1/2 with
    ``offload_optimizer``: wrong on every release measured (0.14.1, 0.16.9,
    0.18.0, 0.19.2, 0.19.8).  The marked-boundary loop with ZeRO-2 +
    offload: wrong before 0.19.0 (0.14.1, 0.16.9 measured; the
    ``gradient_accumulation_steps > 1`` gate read in 0.14.1 and 0.18.9, the
    #7981 gate in 0.19.0), right from 0.19.0 (0.19.2, 0.19.8 measured).  This
    is not ``zero2_offload_accumulation``'s bug: with
    ``gradient_accumulation_steps`` 1 the method that patch wraps is never
    called before 0.19.0.  Stage 0 and ZeRO-3 sum the micro-batches
    (ZeRO-3 + offload measured on 0.19.x only) and are left alone, as is the unmanaged mode.  No
    single source line marks all of it, so no source fingerprint: the patch
    reads the optimizer at run time (``all_grad_tensors`` exists from 0.17.6
    on; the marked-boundary check follows the installed version).

Flag
    ``ZEROSHIM_ZERO_MANUAL_ACCUMULATION=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine.allreduce_gradients`` is wrapped: ``engine.backward()``
    calls it once at its end, and at ZeRO-1/2 it runs the epilogue that fills
    ``averaged_gradients`` (``DeepSpeedEngine.backward`` itself is
    ``zero3_dummy_loss``'s target).  Without offload, on a ZeRO-1/2 optimizer
    that replaces ``averaged_gradients`` at the boundary (it has
    ``all_grad_tensors``), in the default managed mode, when a boundary
    backward finds the partition of an earlier backward still waiting for
    ``step()``: that partition is copied aside and set to ``None`` (which
    also keeps 0.17.6 - 0.18.2 off the crashing branch), DeepSpeed's
    reduction runs, and the copy is added to the new partition: ``step()``
    then sees the sum of every micro-batch since the last step, as DeepSpeed
    up to 0.17.5, stage 0, ZeRO-3 and DeepSpeed's own
    ``set_gradient_accumulation_boundary`` loop give it.  Costs one copy of
    the rank's gradient partition while it is held.  One WARNING on global
    rank 0 the first time.  ``engine.zero_grad()`` between the backward calls
    does not discard the earlier ones (it did not up to 0.17.5 either).
    With ``offload_optimizer`` there is no safe repair (the gradient went to
    the fp32 buffer and the CPU accumulator holds stale sums), so the second
    boundary backward before ``step()`` (a boundary seen at the same
    ``engine.micro_steps``) raises a ``RuntimeError`` at the end of that
    ``backward``, before the step, naming the cause and the remedy for the
    installed release; so does, before 0.19.0, a ZeRO-2 + offload backward
    marked non-boundary with ``gradient_accumulation_steps`` 1 (its gradient
    would never reach the step).  The marked-boundary loop from 0.19.0, the
    ordinary loop (a step after every backward), stage 0, ZeRO-3 and the
    unmanaged mode are not touched (the scenario compares them with and
    without zeroshim: equal bit for bit).  Left as DeepSpeed has it: a
    later phase of one backward under reentrant checkpointing
    (``_epilogue_ran_this_backward``, DeepSpeed >= 0.19: the epilogue runs
    once per phase on cumulative gradients, so adding there would count the
    earlier micro-batches twice; not measured) and ``BF16_Optimizer`` (ZeRO-1
    with bf16 and fp32 gradient accumulation; not measured).

Undo
    ``zeroshim.unpatch("zero_manual_accumulation")`` restores the method.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero_manual_accumulation``.
"""

from __future__ import annotations

import sys

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr

NAME = "zero_manual_accumulation"
#: summed: backward calls whose earlier micro-batches were added back; refused: errors raised (offload)
stats = {"summed": 0, "refused": 0}
_PENDING = "_zeroshim_manual_boundary_at"  # engine attribute: engine.micro_steps at the last boundary backward


def _zero12_optimizer(engine):
    """The engine's ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``), or None."""
    module = sys.modules.get("deepspeed.runtime.zero.stage_1_and_2")
    cls = getattr(module, "DeepSpeedZeroOptimizer", None)
    optimizer = getattr(engine, "optimizer", None)
    return optimizer if cls is not None and isinstance(optimizer, cls) else None


def _managed(engine) -> bool:
    """DeepSpeed's default (managed) accumulation, outside pipelines and ZenFlow."""
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if callable(managed) and not managed():
        return False  # unmanaged mode (DeepSpeed >= 0.19.4): backward only accumulates, step() is the boundary
    return not (getattr(engine, "pipeline_parallelism", False) or getattr(engine, "zenflow", False))


def _drops_marked_micro_steps(optimizer) -> bool:
    """ZeRO-2 + offload with gradient_accumulation_steps 1 before DeepSpeed 0.19.0: a backward marked non-boundary
    (``set_gradient_accumulation_boundary(False)``) never reaches the CPU accumulator (#7981)."""
    from zeroshim import _versions

    installed = _versions.installed("deepspeed")
    return (bool(getattr(optimizer, "partition_gradients", False)) and
            getattr(optimizer, "gradient_accumulation_steps", None) == 1 and installed is not None and
            _versions.base_version(installed) < _versions.base_version("0.19.0"))


def _remedy() -> str:
    from zeroshim import _versions

    installed = _versions.installed("deepspeed") or "0"
    version = _versions.base_version(installed)
    if version >= _versions.base_version("0.19.5"):
        how = ('set "managed_gradient_accumulation": false in the DeepSpeed config (backward then only '
               "accumulates and step() is the boundary), or call engine.set_gradient_accumulation_boundary(False) "
               "before every backward but the last and engine.set_gradient_accumulation_boundary(True) before it")
    elif version >= _versions.base_version("0.19.0"):
        how = ("call engine.set_gradient_accumulation_boundary(False) before every backward but the last and "
               "engine.set_gradient_accumulation_boundary(True) before it (DeepSpeed >= 0.19.5 also offers "
               '"managed_gradient_accumulation": false)')
    else:
        how = ("set gradient_accumulation_steps to the number of micro-batches and call engine.step() after every "
               "engine.backward() (DeepSpeed steps the optimizer at the last one; pass scale_wrt_gas=False to "
               "backward to keep the sum rather than the mean), or upgrade to DeepSpeed >= 0.19.0 and mark the "
               "boundary with engine.set_gradient_accumulation_boundary()")
    return f"deepspeed {installed}: {how}"


def _refusal(engine, marked: bool) -> str:
    stage = int(engine.zero_optimization_stage())
    if marked:
        what = ("engine.backward() at a micro-step marked as no accumulation boundary "
                "(set_gradient_accumulation_boundary(False)) under ZeRO stage 2 with offload_optimizer and "
                "gradient_accumulation_steps=1: DeepSpeed before 0.19.0 never adds this backward's gradient to the "
                "step (only the boundary one counts; fixed by #7981 in 0.19.0), silently")
    else:
        what = (f"engine.backward() called again before engine.step() under ZeRO stage {stage} with "
                "offload_optimizer, and both backward calls are gradient accumulation boundaries (with "
                "gradient_accumulation_steps=1 every backward is one): DeepSpeed would train on part of the "
                "micro-batches only (up to 0.18.x the last one; from 0.19.0 all but the first, plus the previous "
                "step's), silently")
    return f"zeroshim[{NAME}]: {what}. Remedy, {_remedy()}. ZEROSHIM_{NAME.upper()}=off turns this check off."


def _allreduce(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine.allreduce_gradients()``, which ``engine.backward()`` calls once at its end and which
    runs the ZeRO-1/2 epilogue that fills (0.17.6+: replaces) ``averaged_gradients``."""
    held, boundary, refuse, marked = None, False, False, False
    with guard(NAME):
        optimizer = _zero12_optimizer(instance) if instance is not None and is_active(NAME) else None
        managed = optimizer is not None and _managed(instance)
        boundary = managed and bool(instance.is_gradient_accumulation_boundary())
        offload = bool(getattr(optimizer, "cpu_offload", False))
        if managed and offload and not boundary:
            refuse = marked = _drops_marked_micro_steps(optimizer)
        elif boundary and offload:  # a boundary earlier in this step (micro_steps moves in every step())
            refuse = getattr(instance, _PENDING, None) == instance.micro_steps
        elif (boundary and hasattr(optimizer, "all_grad_tensors")  # the replacing epilogue (DeepSpeed >= 0.17.6)
              and not getattr(optimizer, "_epilogue_ran_this_backward", False)):  # not a later reentrant phase
            waiting = {i: grads for i, grads in optimizer.averaged_gradients.items() if grads is not None}
            if waiting:
                held = {i: [g.detach().clone() for g in grads] for i, grads in waiting.items()}
                for i in held:
                    optimizer.averaged_gradients[i] = None  # 0.17.6 - 0.18.2 would take the crashing branch
    if refuse:
        stats["refused"] += 1
        raise RuntimeError(_refusal(instance, marked))
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        if boundary:
            setattr(instance, _PENDING, instance.micro_steps)
    if held:
        optimizer = instance.optimizer
        for i, old in held.items():
            new = optimizer.averaged_gradients.get(i)
            if new is None:  # this call reduced nothing into the partition
                optimizer.averaged_gradients[i] = old
            else:
                for grad, earlier in zip(new, old):
                    grad.add_(earlier)
        stats["summed"] += 1
        _log.acted(NAME, "engine.backward() called again before engine.step() under ZeRO stage %s: the gradients of "
                   "the earlier backward calls were added to this one's",
                   "with gradient_accumulation_steps=1 every backward is an accumulation boundary and DeepSpeed "
                   ">= 0.18.3 keeps only the last one's (0.17.6 - 0.18.2 fail; stage 0, ZeRO-3 and DeepSpeed "
                   "<= 0.17.5 sum them)",
                   int(instance.zero_optimization_stage()))
    return result


def patch_engine(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedEngine")
    require_attr(cls, "allreduce_gradients")
    require_attr(cls, "is_gradient_accumulation_boundary")
    require_attr(cls, "zero_optimization_stage")
    patcher.wrap(cls, "allreduce_gradients", _allreduce)


PATCH = Patch(
    changes=('numbers',),
    on_disagreement="stop",  # without it the earlier micro-batches are dropped, silently
    name=NAME,
    summary="gradient_accumulation_steps 1 and several engine.backward() before one engine.step() under "
            "ZeRO-1/2: only the last micro-batch's gradient is kept (silent; TypeError on 0.17.6–0.18.2; "
            "offload: all releases)",
    signatures=((r"TypeError: 'NoneType' object is not iterable", r"zip\(self\.all_grad_tensors\[i\], avg_new\)"),
                r"zeroshim\[zero_manual_accumulation\]: engine\.backward\(\) (called again before engine\.step\(\)|"
                r"at a micro-step marked as no accumulation boundary)"),
    versions_note=("ZeRO-1/2: DeepSpeed ≥ 0.17.6, a TypeError in 0.17.6–0.18.2, silent from 0.18.3; with "
                   "offload_optimizer every release, an error with the remedy"),
    affects={"deepspeed": ""},
    targets={"deepspeed.runtime.engine": patch_engine},
)
