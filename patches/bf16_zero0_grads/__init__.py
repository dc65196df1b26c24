"""Clear the gradients after each step, and use no loss scale, in DeepSpeed's fp16 wrapper for bf16 (DeepSpeed 0.17.6-0.18.5).

Symptom
    Nothing fails.  With ``bf16`` enabled and no ZeRO (stage 0), DeepSpeed 0.17.6-0.18.5 wrap a non-fused optimizer
    (torch's AdamW, the HF Trainer's own when the DeepSpeed config has no ``optimizer`` section) in their fp16
    wrapper, ``FP16_UnfusedOptimizer``, with the fp16 section's dynamic loss scale, 65536 at first.  0.17.6-0.18.4 do
    the same where ``BF16_Optimizer`` was asked for (bf16 ZeRO-1 or stage 0 with ``grad_accum_dtype`` fp32, bf16
    pipelines): there ``BFLOAT16`` and ``DDP_BFLOAT16`` are the same string, so that branch is never reached (0.18.5,
    #7790, renames the second), and such a ZeRO-1 run partitions nothing and accumulates in bf16.  Then:

    * without ZeRO the gradients are never cleared after a step: a loop that calls only ``engine.backward()`` and
      ``engine.step()`` steps with the sum of every gradient since the first step, and the gradient norms grow
      from step to step.  So does an accelerate loop (under DeepSpeed its optimizer's ``zero_grad()`` does nothing:
      run with accelerate 1.15.0 on 0.18.2).  The HF Trainer, and TRL's trainers built on it, clear the gradients themselves
      (``model.zero_grad()``) and do not see this part;
    * on 0.18.3-0.18.5 the gradients are divided by 65536 at every step although the loss was never multiplied by
      it: Adam's steps shrink wherever a gradient divided by 65536 comes near its ``eps``, and gradient clipping
      compares a norm 65536 times too small, so it clips only norms above 65536 times the limit.  Every such run,
      the HF Trainer's included;
    * on 0.17.6-0.18.2 the reported gradient norm (``engine.get_global_grad_norm()``, the Trainer's ``grad_norm``)
      is 65536 times too large.  The steps themselves are right there: the loss is multiplied by the scale, and
      multiplying by a power of two is exact (until the dynamic scale, which doubles after every 1000 steps without
      an overflow, grows into one: then DeepSpeed skips steps).

    DeepSpeed's fused fp16 wrapper (``FP16_Optimizer``, for its own FusedAdam) uses no scale for bf16 and clears
    the gradients in its step: not affected.

Cause
    0.17.6 (#7515, "Enable non-ZeRO mode") sends bf16 without ZeRO to the fp16 wrapper, whose loss scale comes from
    the ``fp16`` section (dynamic by default), and adds ``DDP_BFLOAT16`` with the same value as ``BFLOAT16``.
    ``_take_model_step``'s bf16 branch clears the gradients only under ZeRO (``else: pass``).  0.18.3 (#7665,
    "PyTorch-compatible backward API") multiplies the loss by the scale only for ZeRO optimizers; the wrapper still
    divides by it.  0.18.6 (#7839, for #7837: "Fix bf16 gradient norm divergence with ZeRO stage 0") uses no loss
    scale for bf16 and clears the gradients after the step.

Affected versions
    DeepSpeed >= 0.17.6, < 0.18.6, read in the sdists 0.17.6, 0.18.5 and 0.18.6 and at the tags v0.17.5, v0.18.2,
    v0.18.3, v0.18.4 and v0.18.5: 0.17.5 refuses bf16 without ZeRO unless gradients accumulate in fp32
    (``BF16_Optimizer``, which clears its own); 0.17.6-0.18.5 choose the fp16 wrapper (``else DDP_BFLOAT16``) and
    skip clearing (the two together are the source fingerprint); 0.18.6 clears.  Reproduced on CPU, 2 ranks: 0.18.2
    and 0.18.5 leave the gradients after every step; 0.18.5 steps with them divided by 65536; 0.18.2 builds the fp16
    wrapper for bf16 ZeRO-1 with fp32 accumulation.  The fp16 wrapper with fp16 (not bf16) is not touched: fp16
    cannot run on the CPU here.

Flag
    ``ZEROSHIM_BF16_ZERO0_GRADS=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine._configure_fp16_optimizer`` is wrapped: where it builds ``FP16_UnfusedOptimizer`` for bf16,
    its loss scale is made static and 1 (``dynamic_loss_scale`` off, ``cur_scale`` 1.0), as 0.18.6 uses no scale
    for bf16, and it stays so after ``load_state_dict`` (a checkpoint saved with the old scale would bring it back).
    ``DeepSpeedEngine._take_model_step`` is wrapped: after the step, without ZeRO, such a wrapper's ``zero_grad()``
    is called, as 0.18.6 does (under ZeRO DeepSpeed clears them itself); a wrapper built before zeroshim applied is
    taken up there, after its first step.  On 0.17.6-0.18.2 the scale of 1 gives the same steps bit for bit while
    the dynamic scale has not overflowed (only the reported norm changes); a loop that clears the gradients itself
    trains the same.  Where it acts it changes the numbers of the rest (on 0.18.3-0.18.5 every such run): said once
    per job at WARNING, which also names the lost ZeRO-1 partitioning and fp32 accumulation where that is the case
    (not fixed: the remedy is DeepSpeed >= 0.18.5).  Ranks that disagree stop.

Undo
    ``zeroshim.unpatch("bf16_zero0_grads")`` restores the three methods.  Wrappers built before keep a loss scale of
    1, which is exact on 0.17.6-0.18.2 and right on 0.18.3-0.18.5.

Evidence
    benchmarks/RESULTS.md, ``bf16_zero0_grads``.
"""

from __future__ import annotations

import weakref

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "bf16_zero0_grads"
#: unscaled: bf16 wrappers whose loss scale was made static 1 (at construction, after a load, or after the first step
#: of one built before zeroshim applied); cleared: steps after which a bf16 wrapper's gradients were cleared
stats = {"unscaled": 0, "cleared": 0}
_ours = weakref.WeakSet()  # the bf16 FP16_UnfusedOptimizers this patch set to a loss scale of 1
_unfused: list = []  # FP16_UnfusedOptimizer, once the engine's module is patched


def _unscale(optimizer, engine, when: str) -> None:
    """The wrapper's loss scale made static and 1, as DeepSpeed 0.18.6 has it for bf16."""
    if getattr(optimizer, "dynamic_loss_scale", False) or getattr(optimizer, "cur_scale", 1.0) != 1.0:
        optimizer.dynamic_loss_scale = False
        optimizer.cur_scale = 1.0
        stats["unscaled"] += 1
        _say(engine, when)


def _say(engine, when: str) -> None:
    unscaled = _versions.in_range(_versions.installed("deepspeed") or "0", ">=0.18.3")
    scale = ("the loss is not multiplied by it, so every gradient is divided by 65536" if unscaled else
             "the steps are exact, the reported gradient norm is 65536 times too large")
    if engine is not None and engine.zero_optimization():
        _log.acted(NAME, "used no loss scale in DeepSpeed's fp16 wrapper for bf16 (%s), as DeepSpeed 0.18.6 does",
                   "DeepSpeed %s builds that wrapper, with a loss scale of 65536, where BF16_Optimizer was asked for "
                   "(bf16 ZeRO-%s with fp32 gradient accumulation: its BFLOAT16 and DDP_BFLOAT16 are the same string), "
                   "and %s.  Not fixed: that run partitions no optimizer state and accumulates gradients in bf16, "
                   "not fp32; DeepSpeed >= 0.18.5 builds BF16_Optimizer", when, _versions.shown("deepspeed"),
                   engine.zero_optimization_stage(), scale)
    else:
        _log.acted(NAME, "used no loss scale for bf16 without ZeRO (%s) and clears the gradients after each step, "
                         "as DeepSpeed 0.18.6 does", "DeepSpeed %s wraps that optimizer in its fp16 wrapper with a "
                   "loss scale of 65536 (%s) and never clears its gradients (a loop that does not clear them steps "
                   "with their sum)", when, _versions.shown("deepspeed"), scale)


def _is_unfused(optimizer) -> bool:
    return bool(_unfused) and isinstance(optimizer, _unfused[0])


def _configure(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._configure_fp16_optimizer(optimizer, low_precision_dtype)``."""
    optimizer = wrapped(*args, **kwargs)
    with guard(NAME):
        import torch  # imported by DeepSpeed already; never by ``import zeroshim``

        dtype = args[1] if len(args) > 1 else kwargs.get("low_precision_dtype")
        if is_active(NAME) and dtype is torch.bfloat16 and _is_unfused(optimizer):
            _ours.add(optimizer)
            _unscale(optimizer, instance, "at the start")
    return optimizer


def _load_state_dict(wrapped, instance, args, kwargs):
    """Wraps ``FP16_UnfusedOptimizer.load_state_dict``: a bf16 wrapper keeps its scale of 1."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        if is_active(NAME) and instance in _ours:
            _unscale(instance, None, "after loading a checkpoint")
    return result


def _take_model_step(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._take_model_step``: a bf16 wrapper's gradients cleared after the step (without ZeRO;
    DeepSpeed clears them under ZeRO), and a wrapper built before zeroshim applied taken up."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        optimizer = getattr(instance, "optimizer", None)
        if not is_active(NAME) or optimizer is None:
            return result
        if optimizer not in _ours:
            if not (instance.bfloat16_enabled() and _is_unfused(optimizer)):
                return result
            _ours.add(optimizer)
            # safe after the step: its gradients, formed under the old scale, are cleared below (or by DeepSpeed
            # under ZeRO) before the next backward
            _unscale(optimizer, instance, "from the step after zeroshim applied")
        if not instance.zero_optimization():
            optimizer.zero_grad()
            stats["cleared"] += 1
    return result


def patch_engine(module, patcher: Patcher) -> None:
    engine = require_attr(module, "DeepSpeedEngine")
    require_params(engine._configure_fp16_optimizer, "optimizer", "low_precision_dtype")
    require_attr(engine, "_take_model_step")
    unfused = require_attr(module, "FP16_UnfusedOptimizer")
    require(callable(getattr(unfused, "zero_grad", None)), "FP16_UnfusedOptimizer.zero_grad does not exist")
    require_attr(unfused, "load_state_dict")
    patcher.wrap(engine, "_configure_fp16_optimizer", _configure)
    patcher.wrap(engine, "_take_model_step", _take_model_step)
    patcher.wrap(unfused, "load_state_dict", _load_state_dict)
    _unfused[:] = [unfused]


def _reset() -> None:
    _ours.clear()
    _unfused.clear()


PATCH = Patch(
    changes=("numbers",),
    on_disagreement="stop",  # without it a rank sums its gradients over the steps, or divides them by 65536
    name=NAME,
    summary="bf16 in DeepSpeed's fp16 wrapper (no ZeRO; also ZeRO-1 with fp32 accumulation up to 0.18.4): gradients "
            "never cleared after a step without ZeRO, and on 0.18.3-0.18.5 divided by a loss scale of 65536 the loss "
            "never got (silent)",
    signatures=(),
    affects={"deepspeed": ">=0.17.6,<0.18.6"},
    fingerprint=Fingerprint("deepspeed.runtime.engine",
                            r"(?s)else DDP_BFLOAT16\b.*if self\.zero_optimization\(\) and hasattr\(self\.optimizer, "
                            r"\"zero_grad\"\):\s*self\.optimizer\.zero_grad\(\)\s*else:\s*pass",
                            "bf16 without ZeRO sent to the fp16 wrapper, and _take_model_step's bf16 branch clearing "
                            "gradients only under ZeRO"),
    targets={"deepspeed.runtime.engine": patch_engine},
    on_undo=_reset,
)
