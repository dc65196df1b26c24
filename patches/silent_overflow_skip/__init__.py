"""Say when ZeRO-1/2 skips an optimizer step for inf or NaN gradients without a dynamic loss scale, as DeepSpeed
0.19.8 does.

Symptom
    Nothing is said.  Under ZeRO stage 1 or 2 in bf16 with ``bf16.check_grad_overflow`` (DeepSpeed's default from
    0.19.3; a setting from 0.17.1), or in fp16 with a static ``loss_scale``, a step whose gradients hold inf or NaN
    is skipped: the weights and the learning-rate schedule stay where they were, the engine counts it in
    ``skipped_steps``, and nothing is logged.  The gradient norm DeepSpeed reports for that step
    (``engine.get_global_grad_norm()``, the HF Trainer's ``grad_norm``) is the previous step's.  A loss that
    overflows on every step therefore trains nothing while the logs look healthy (DeepSpeed #8415).  With fp16's
    dynamic loss scale DeepSpeed says "OVERFLOW! ... Skipping step" itself: not affected.

Cause
    The static ``LossScaler.update_scale`` is ``pass``, and ``DeepSpeedZeroOptimizer.step`` returns on overflow
    before it computes the gradient norm.  DeepSpeed 0.19.8 logs "[deepspeed] OVERFLOW! Skipping step. Gradients
    are non-finite, weights were not updated." from the static scaler and reports the skipped step's norm as inf.

Affected versions
    DeepSpeed < 0.19.8, read from the released sdists: ``update_scale`` is ``pass`` in 0.12.3, 0.14.1, 0.18.5,
    0.19.2, 0.19.5 and 0.19.7 (the source fingerprint); 0.19.8 logs.  Reached by default by bf16 ZeRO-1/2 on
    0.19.3-0.19.7 (OpenRLHF pins 0.19.5), and with ``"check_grad_overflow": true`` from 0.17.1.  ZeRO-3 does not
    check bf16 gradients before 0.19.8.

Flag
    ``ZEROSHIM_SILENT_OVERFLOW_SKIP=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedZeroOptimizer.step`` is wrapped: where it returns with ``overflow`` set and a loss scaler that is
    not dynamic, zeroshim logs at WARNING, on global rank 0 (every rank skips the same step), that the step was
    skipped for inf or NaN gradients, and sets the skipped step's reported gradient norm to inf, as 0.19.8 does.
    Nothing the run trains changes: the same weights, the same steps skipped.  A run without overflow is not
    touched.  A skip that patch ``nonfinite_grad_step`` decided (the gradient norm not finite where DeepSpeed's
    own check found nothing) is said by that patch, not again here.

Undo
    ``zeroshim.unpatch("silent_overflow_skip")`` restores ``step``.

Evidence
    benchmarks/RESULTS.md, ``silent_overflow_skip``.
"""

from __future__ import annotations

from zeroshim import _flags, _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "silent_overflow_skip"
#: said: skipped steps zeroshim reported
stats = {"said": 0}
#: set on the optimizer by a patch that decided the skip itself (``nonfinite_grad_step``), which says it
SKIPPED_BY = "_zeroshim_skipped_by"


def _step(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer.step()``."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        if is_active(NAME) and getattr(instance, "overflow", False) is True \
                and not getattr(getattr(instance, "loss_scaler", None), "dynamic", False) \
                and vars(instance).get(SKIPPED_BY) is None:
            stats["said"] += 1
            if hasattr(instance, "_global_grad_norm"):
                instance._global_grad_norm = float("inf")
            # every rank skips the same step (the overflow is all-reduced): said on global rank 0
            _log.warning("zeroshim[%s]: DeepSpeed skipped this optimizer step (%d so far in this process): the "
                         "gradients hold inf or NaN (%s), so the weights and the learning-rate schedule were not "
                         "updated, and the gradient norm is reported as inf. DeepSpeed %s skips such steps without "
                         "a word (0.19.8 says it). %s=off turns this off.", NAME, stats["said"], _why(instance),
                         _versions.shown("deepspeed"), _flags.env_name(NAME), scope=_log.RANK0)
    return result


def _why(optimizer) -> str:
    import torch

    if getattr(optimizer, "dtype", None) == torch.bfloat16:
        return "bf16.check_grad_overflow, DeepSpeed's default from 0.19.3"
    return "a static loss_scale"


def patch_stage_1_and_2(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedZeroOptimizer")
    require_attr(cls, "step")
    patcher.wrap(cls, "step", _step)


PATCH = Patch(
    changes=("error",),  # a step skipped in silence is said; what the run trains is the same
    name=NAME,
    summary="ZeRO-1/2 in bf16 (overflow check on: the default from DeepSpeed 0.19.3) or with a static fp16 loss "
            "scale skips every step whose gradients hold inf or NaN without a word, and reports the previous "
            "step's gradient norm (silent)",
    signatures=(),
    affects={"deepspeed": "<0.19.8"},
    fingerprint=Fingerprint("deepspeed.runtime.fp16.loss_scaler",
                            r"def update_scale\(self, overflow\):\s*pass",
                            "an update_scale that says nothing on overflow (the static scaler's, or the base class's "
                            "it inherits; 0.19.8 logs)"),
    targets={"deepspeed.runtime.zero.stage_1_and_2": patch_stage_1_and_2},
)
