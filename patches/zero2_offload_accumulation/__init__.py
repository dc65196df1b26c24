"""Keep every micro-batch's gradient with ZeRO-2 + optimizer offload + gradient accumulation >= 3.

Symptom
    None: training runs, the loss curve is just worse.  With ZeRO stage 2,
    ``offload_optimizer`` (cpu or nvme) and ``gradient_accumulation_steps`` of
    3 or more, each optimizer step uses the gradients of the first and the
    last micro-batch only; the ones in between are lost.  Gradient norms are
    too small (reproduced on 0.16.9, 1 rank, GA = 4: 0.525 / 0.463 / 0.380
    against 0.681 / 0.705 / 0.669 without offload) and the parameters differ.
    GA = 2, ZeRO-1 and ZeRO-3 are unaffected.  ``zeroshim doctor --config``
    flags the combination.

Cause
    ``DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu(param)``
    keeps the running sum of a parameter's gradient partition in a CPU buffer
    across micro-steps (ZeRO-2 clears ``param.grad`` after every micro-step).
    Since #6550 its tail reads::

        if self.micro_step_id > 0:
            accumulate_gradients()      # param.grad += buffer
        else:
            copy_gradients_to_cpu()     # buffer = param.grad

    so after micro-step 0 the sum is formed on the device but never copied
    back: micro-step 1 forms g0+g1 and drops it, micro-step 2 forms g0+g2 and
    drops it, the boundary micro-step 3 forms g0+g3, which is what reaches the
    fp32 gradient.  The fix (#7967) copies the sum back after every micro-step.

Affected versions
    DeepSpeed >= 0.15.2, < 0.19.0, read from the released sdists
    (stage_1_and_2.py, the tail of ``async_accumulate_grad_in_cpu_via_gpu``):
    up to 0.15.1 the tail is ``if micro_step_id > 0: accumulate_gradients()``
    followed by ``if not is_gradient_accumulation_boundary:
    copy_gradients_to_cpu()`` (correct); #6550, first released in 0.15.2,
    turned the second ``if`` into the ``else`` above; #7967, first released in
    0.19.0, copies back unconditionally.  The ``else`` shape is the source
    fingerprint (present in exactly 0.15.2-0.18.9).

Flag
    ``ZEROSHIM_ZERO2_OFFLOAD_ACCUMULATION=auto|on|off`` (default ``auto``).

Fix
    ``async_accumulate_grad_in_cpu_via_gpu`` is wrapped: after the original
    ran, on a micro-step after the first that is not the accumulation
    boundary, it is called once more with ``micro_step_id`` set to 0 for that
    call, which takes DeepSpeed's own ``copy_gradients_to_cpu`` branch
    (including its narrowing for fp16 master weights and gradients): the
    buffer then holds the sum, as in 0.15.1 and 0.19.0.  The boundary is
    left alone on purpose: ZeRO-1 calls the method once per step, at the
    boundary, with ``micro_step_id`` at GA-1, and copying the sum back there
    would add it again at the next step.  Numerics: the sum is the one the
    device formed; the step equals the same run without offload as far as
    the accumulation order allows (the tests compare it: bit for bit on the
    CPU).  One WARNING per job
    the first time a sum is copied back (what, why, the flag): it changes the
    numbers the user's run trains on.

Undo
    ``zeroshim.unpatch("zero2_offload_accumulation")`` restores the method.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero2_offload_accumulation``.
"""

from __future__ import annotations

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "zero2_offload_accumulation"
#: micro-steps whose sum was copied back (introspection and tests)
stats = {"copied_back": 0}


def _boundary(optimizer) -> bool:
    flag = getattr(optimizer, "is_gradient_accumulation_boundary", True)
    return bool(flag() if callable(flag) else flag)


def _accumulate(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu(param)``."""
    result = wrapped(*args, **kwargs)
    again = False
    with guard(NAME):
        again = is_active(NAME) and getattr(instance, "micro_step_id", 0) > 0 and not _boundary(instance)
    if again:
        step = instance.micro_step_id
        instance.micro_step_id = 0  # DeepSpeed's own branch: buffer = param.grad (the sum so far)
        try:
            wrapped(*args, **kwargs)
        finally:
            instance.micro_step_id = step
        stats["copied_back"] += 1
        if stats["copied_back"] == 1:  # the first copy-back in this process (acted() itself logs once)
            _log.acted(NAME, "kept the gradient sum of every micro-batch in the CPU offload buffer (ZeRO-2, "
                             "offload_optimizer, gradient accumulation >= 3)", "DeepSpeed %s otherwise drops the "
                             "gradients of the micro-batches between the first and the last of each step, without "
                             "an error", _versions.installed("deepspeed"))
    return result


def patch_stage12(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedZeroOptimizer")
    require_attr(cls, "async_accumulate_grad_in_cpu_via_gpu")
    patcher.wrap(cls, "async_accumulate_grad_in_cpu_via_gpu", _accumulate)


def check_config(cfg, affected: bool) -> list:
    """``zeroshim doctor --config``: ZeRO-2 + optimizer offload + GA >= 3 on an affected release."""
    ga = cfg.gradient_accumulation_steps
    risky_ga = ga == "auto" or (isinstance(ga, int) and ga >= 3)
    if not (affected and cfg.stage == 2 and cfg.offload_optimizer in ("cpu", "nvme") and risky_ga):
        return []
    return [{"level": "error",
             "message": f"ZeRO-2 with offload_optimizer={cfg.offload_optimizer} and gradient_accumulation_steps={ga} "
                        f"trains on wrong gradients on deepspeed {_versions.installed('deepspeed')} (only the first "
                        "and last micro-batch of each step count; nothing fails)."}]


PATCH = Patch(
    changes=('numbers',),
    on_disagreement="stop",  # without it the middle micro-batches are lost, silently
    name=NAME,
    summary="ZeRO-2 + offload_optimizer + gradient accumulation >= 3: micro-batches between the first and the last "
            "are silently dropped",
    signatures=(),  # silent: `zeroshim doctor --config` is how users find it
    affects={"deepspeed": ">=0.15.2,<0.19.0"},
    fingerprint=Fingerprint(
        "deepspeed.runtime.zero.stage_1_and_2",
        r"if self\.micro_step_id > 0:\s*\n\s*accumulate_gradients\(\)\s*\n\s*else:\s*\n\s*copy_gradients_to_cpu\(\)",
        "the accumulate-or-copy tail of async_accumulate_grad_in_cpu_via_gpu (#6550)"),
    targets={"deepspeed.runtime.zero.stage_1_and_2": patch_stage12},
    check_config=check_config,
)
