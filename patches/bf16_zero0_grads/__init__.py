"""Clear the gradients after each step, and use no loss scale, for bf16 without ZeRO (DeepSpeed 0.17.6-0.18.5).

Symptom
    Nothing fails.  With ``bf16`` enabled and no ZeRO (stage 0), DeepSpeed 0.17.6-0.18.5 wrap the optimizer in their
    fp16 wrapper (``FP16_UnfusedOptimizer``; ``FP16_Optimizer`` for a fused Adam) with the fp16 section's dynamic
    loss scale, 65536 at first (0.18.2 does so even with ``grad_accum_dtype`` fp32).  Then:

    * the gradients are never cleared after a step: a loop that calls only ``engine.backward()`` and
      ``engine.step()`` steps with the sum of every gradient since the first step, and the gradient norms grow
      from step to step.  So does an accelerate loop (under DeepSpeed its optimizer's ``zero_grad()`` does nothing:
      read in accelerate 1.15.0).  The HF Trainer, and TRL's trainers built on it, clear the gradients themselves
      (``model.zero_grad()``) and do not see this part;
    * on 0.18.3-0.18.5 the gradients are divided by 65536 at every step although the loss was never multiplied by
      it: Adam's steps shrink wherever a gradient divided by 65536 comes near its ``eps``, and gradient clipping
      judges a norm 65536 times too small, so it never clips.  Every such run, the HF Trainer's included;
    * on 0.17.6-0.18.2 the reported gradient norm (``engine.get_global_grad_norm()``, the Trainer's ``grad_norm``)
      is 65536 times too large.  The steps themselves are right there: the loss is multiplied by the scale, and
      multiplying by a power of two is exact.

Cause
    0.17.6 (#7515, "Enable non-ZeRO mode") sends bf16 without ZeRO to the fp16 wrapper, whose loss scale comes from the ``fp16`` section (dynamic by default).  ``_take_model_step``'s bf16
    branch clears the gradients only under ZeRO (``else: pass``).  0.18.3 (#7665, "PyTorch-compatible backward
    API") multiplies the loss by the scale only for ZeRO optimizers; the wrapper still divides by it.  0.18.6
    (#7839, for #7837: "Fix bf16 gradient norm divergence with ZeRO stage 0") uses no loss scale for bf16 and
    clears the gradients after the step.

Affected versions
    DeepSpeed >= 0.17.6, < 0.18.6, read in the sdists 0.17.6, 0.18.5 and 0.18.6 and at the tags v0.17.5, v0.18.2
    and v0.18.3: 0.17.5 refuses bf16 without ZeRO unless gradients accumulate in fp32 (``BF16_Optimizer``, which
    clears its own); 0.17.6-0.18.5 choose the fp16 wrapper (``else DDP_BFLOAT16``) and skip clearing (the two
    together are the source fingerprint); 0.18.6 clears.  Reproduced on CPU, 2 ranks: 0.18.2 and 0.18.5 leave
    the gradients after every step; 0.18.5 steps with them divided by 65536.  The fp16 wrapper with fp16 (not bf16)
    is not touched: fp16 cannot run on the CPU here.

Flag
    ``ZEROSHIM_BF16_ZERO0_GRADS=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine._configure_fp16_optimizer`` is wrapped: where it wraps for bf16, the wrapper's loss scale is
    made static and 1 (``dynamic_loss_scale`` off, ``cur_scale`` 1.0), as 0.18.6 uses no scale for bf16, and it
    stays so after ``load_state_dict`` (a checkpoint saved with the old scale would bring it back).
    ``DeepSpeedEngine._take_model_step`` is wrapped: after the step, such a wrapper's ``zero_grad()`` is called,
    as 0.18.6 does.  On 0.17.6-0.18.2 the scale of 1 gives the same steps bit for bit (only the reported norm
    changes); a loop that clears the gradients itself trains the same.  Where it acts it changes the numbers of
    the rest (on 0.18.3-0.18.5 every such run): said once per job at WARNING.  Ranks that disagree stop.

Undo
    ``zeroshim.unpatch("bf16_zero0_grads")`` restores the four methods.  Wrappers built before keep a loss scale of
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
#: unscaled: bf16 wrappers whose loss scale was made static 1 (at construction or after a load);
#: cleared: steps after which a bf16 wrapper's gradients were cleared
stats = {"unscaled": 0, "cleared": 0}
_ours = weakref.WeakSet()  # the bf16 wrappers this patch set to a loss scale of 1


def _unscale(optimizer, when: str) -> None:
    """The wrapper's loss scale made static and 1, as DeepSpeed 0.18.6 has it for bf16."""
    if getattr(optimizer, "dynamic_loss_scale", False) or getattr(optimizer, "cur_scale", 1.0) != 1.0:
        optimizer.dynamic_loss_scale = False
        optimizer.cur_scale = 1.0
        stats["unscaled"] += 1
        _say(when)


def _say(when: str) -> None:
    _log.acted(NAME, "used no loss scale for bf16 without ZeRO (%s) and clears the gradients after each step, as "
                     "DeepSpeed 0.18.6 does", "DeepSpeed %s wraps that optimizer in its fp16 wrapper with a loss scale "
               "of 65536 (%s) and never clears its gradients (a loop that does not clear them steps with their sum)",
               when, _versions.shown("deepspeed"),
               "the loss is not multiplied by it, so every gradient is divided by 65536"
               if _versions.in_range(_versions.installed("deepspeed") or "0", ">=0.18.3") else
               "the steps are exact, the reported gradient norm is 65536 times too large")


def _configure(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._configure_fp16_optimizer(optimizer, low_precision_dtype)``."""
    optimizer = wrapped(*args, **kwargs)
    with guard(NAME):
        import torch  # imported by DeepSpeed already; never by ``import zeroshim``

        dtype = args[1] if len(args) > 1 else kwargs.get("low_precision_dtype")
        if is_active(NAME) and dtype is torch.bfloat16 and hasattr(optimizer, "cur_scale"):
            _ours.add(optimizer)
            _unscale(optimizer, "at the start")
    return optimizer


def _load_state_dict(wrapped, instance, args, kwargs):
    """Wraps the fp16 wrappers' ``load_state_dict``: a bf16 wrapper keeps its scale of 1."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        if is_active(NAME) and instance in _ours:
            _unscale(instance, "after loading a checkpoint")
    return result


def _take_model_step(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._take_model_step``: a bf16 wrapper's gradients cleared after the step."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        optimizer = getattr(instance, "optimizer", None)
        if is_active(NAME) and optimizer in _ours and not instance.zero_optimization():
            optimizer.zero_grad()
            stats["cleared"] += 1
    return result


def patch_engine(module, patcher: Patcher) -> None:
    engine = require_attr(module, "DeepSpeedEngine")
    require_params(engine._configure_fp16_optimizer, "optimizer", "low_precision_dtype")
    require_attr(engine, "_take_model_step")
    owners = [require_attr(module, name) for name in ("FP16_UnfusedOptimizer", "FP16_Optimizer")]
    for owner in owners:
        require(callable(getattr(owner, "zero_grad", None)), f"{owner.__name__}.zero_grad does not exist")
        require_attr(owner, "load_state_dict")
    patcher.wrap(engine, "_configure_fp16_optimizer", _configure)
    patcher.wrap(engine, "_take_model_step", _take_model_step)
    for owner in owners:
        patcher.wrap(owner, "load_state_dict", _load_state_dict)


def _reset() -> None:
    _ours.clear()


PATCH = Patch(
    changes=("numbers",),
    on_disagreement="stop",  # without it a rank sums its gradients over the steps, or divides them by 65536
    name=NAME,
    summary="bf16 without ZeRO (DeepSpeed's fp16 wrapper): gradients never cleared after a step, and on 0.18.3-0.18.5 "
            "divided by a loss scale of 65536 the loss never got (silent)",
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
