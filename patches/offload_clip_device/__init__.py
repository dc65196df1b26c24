"""Bring the gradient norm to the gradients' device before unscale/clip (ZeRO optimizer offload).

Symptom
    ZeRO-3 with ``offload_optimizer`` (and usually ``offload_param``) on the CPU,
    at the first step whose gradient norm exceeds ``gradient_clipping``::

        RuntimeError: Expected all tensors to be on the same device, but found
        at least two devices, cuda:0 and cpu!

    at ``self.fp32_partitioned_groups_flat[sub_group_id].grad.mul_(1. /
    combined_scale)`` in stage3.py ``unscale_and_clip_grads``.  Steps whose
    norm stays under the threshold pass, so short runs look fine.  Upstream
    reports: DeepSpeed #5538, #5634; QwenLM/Qwen3 #566 (Qwen2-72B SFT), XTuner
    Yi-34B on 0.14.1.

Cause
    ``step()`` of the ZeRO-3 optimizer computes the global gradient norm from
    the per-group norms and hands it to ``unscale_and_clip_grads``.  DeepSpeed
    0.14.1 (#5256, "stage3: efficient compute of scaled_global_grad_norm")
    computes it as ``torch.norm(torch.stack(norm_groups))``: a 0-dim tensor on
    the accelerator.  When clipping fires, ``combined_scale`` becomes that CUDA
    tensor and is multiplied into fp32 gradient partitions that live on the
    CPU; torch lets a 0-dim CPU tensor take part in a CUDA operation, never the
    reverse.

Affected versions
    DeepSpeed 0.14.1 and 0.14.2 only, read from the released sdists of
    0.12.6 to 0.14.5 (stage3.py, ``step``):

    * up to 0.14.0: ``get_global_norm(norm_list=norm_groups)``, which ends in
      ``math.sqrt`` and returns a Python float (the per-group norms are device
      tensors since #4436 in 0.13.0, but the float is what reaches the clip);
    * 0.14.1, 0.14.2: ``scaled_global_grad_norm =
      torch.norm(torch.stack(norm_groups))`` (stage3.py:2030), a device tensor;
    * 0.14.3, 0.14.4: ``get_global_norm`` again (#5461 reverted #5256), a float;
    * 0.14.5 on: the per-group norm calculation returns ``total_norm.cpu()``
      (#5504), a CPU tensor.

    So the gate is ``>=0.14.1,<0.14.3``, and the source fingerprint
    ``torch.norm(torch.stack(norm_groups))`` in ``stage3.py`` (present in
    exactly those two releases) decides for builds with other version numbers.
    Reproduced on an H100 with 0.14.1 (torch 2.11).  ZeRO-1/2 offload computes
    the norm with ``.item()`` (a float, or a CPU tensor) in every release of
    that range and is not affected; its ``unscale_and_clip_grads`` is guarded
    all the same.

Flag
    ``ZEROSHIM_OFFLOAD_CLIP_DEVICE=auto|on|off`` (default ``auto``).

Fix
    ``unscale_and_clip_grads`` of the ZeRO-3 optimizer (per sub-group) and of
    the ZeRO-1/2 optimizer (per gradient group) are wrapped: a tensor norm
    that is not on the device of the gradient partition it scales is moved
    there first, so the clip coefficient and ``combined_scale`` are computed on
    that device.  Each sub-group is handled on its own, so partially offloaded
    optimizers (some sub-groups on the accelerator, ``ratio < 1``) get the norm
    where each sub-group lives.  The loss scale is a Python float in every
    affected release and needs no move.  Moving a float32 scalar between
    devices is exact and the arithmetic that follows is correctly rounded on
    both, so the step is bit-identical to the one an unaffected release
    computes (0.14.5 moves the norm to the CPU once, before the same
    arithmetic).

Undo
    ``zeroshim.unpatch("offload_clip_device")`` restores both methods.
"""

from __future__ import annotations

from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_params
from zeroshim._source import Fingerprint

NAME = "offload_clip_device"


def _device_of(grad_groups_flat):
    """The one device of a (possibly nested) list of gradient tensors, else None."""
    devices = set()
    stack = list(grad_groups_flat)
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "device"):
            devices.add(item.device)
    return devices.pop() if len(devices) == 1 else None


def _colocate(total_norm, device):
    if device is not None and hasattr(total_norm, "device") and total_norm.device != device:
        return total_norm.to(device)
    return total_norm


# -- wrappers -------------------------------------------------------------------------
def _stage3_unscale_and_clip(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads(sub_group_id, total_norm)``."""
    with guard(NAME):
        if is_active(NAME) and len(args) == 2 and not kwargs:
            sub_group_id, total_norm = args
            grad = instance.fp32_partitioned_groups_flat[sub_group_id].grad
            if grad is not None:
                args = (sub_group_id, _colocate(total_norm, grad.device))
    return wrapped(*args, **kwargs)


def _stage12_unscale_and_clip(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer.unscale_and_clip_grads(grad_groups_flat, total_norm)``."""
    with guard(NAME):
        if is_active(NAME) and len(args) == 2 and not kwargs:
            grad_groups_flat, total_norm = args
            args = (grad_groups_flat, _colocate(total_norm, _device_of(grad_groups_flat)))
    return wrapped(*args, **kwargs)


# -- applying -------------------------------------------------------------------------
def patch_stage3(module, patcher: Patcher) -> None:
    cls = getattr(module, "DeepSpeedZeroOptimizer_Stage3", None)
    require(cls is not None, "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3 does not exist")
    require_params(cls.unscale_and_clip_grads, "sub_group_id", "total_norm")
    patcher.wrap(cls, "unscale_and_clip_grads", _stage3_unscale_and_clip)


def patch_stage12(module, patcher: Patcher) -> None:
    cls = getattr(module, "DeepSpeedZeroOptimizer", None)
    require(cls is not None, "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer does not exist")
    require_params(cls.unscale_and_clip_grads, "grad_groups_flat", "total_norm")
    patcher.wrap(cls, "unscale_and_clip_grads", _stage12_unscale_and_clip)


def check_config(cfg, affected: bool) -> list:
    """``zeroshim doctor --config``: ZeRO-3 + optimizer offload + clipping on an affected release."""
    if not (affected and cfg.stage == 3 and cfg.offload_optimizer in ("cpu", "nvme") and cfg.clipping):
        return []
    from zeroshim import _versions

    return [{"level": "error",
             "message": f"ZeRO-3 with offload_optimizer={cfg.offload_optimizer} and gradient_clipping="
                        f"{cfg.gradient_clipping} fails on deepspeed {_versions.installed('deepspeed')} at the first "
                        "clipped step ('Expected all tensors to be on the same device')."}]


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="ZeRO offload + gradient clipping: 'Expected all tensors to be on the same device ... cuda:0 and cpu'",
    signatures=(
        # what makes it this bug: raised in DeepSpeed's unscale/clip of the gradient partitions
        (r"Expected all tensors to be on the same device, but found at least two devices, (cuda:\d+|cpu) and "
         r"(cuda:\d+|cpu)", r"in unscale_and_clip_grads|mul_\(1\. / combined_scale\)"),
    ),
    affects={"deepspeed": ">=0.14.1,<0.14.3"},
    fingerprint=Fingerprint("deepspeed.runtime.zero.stage3", r"torch\.norm\(torch\.stack\(norm_groups\)\)",
                            "ZeRO-3's global norm as a device tensor (torch.norm(torch.stack(norm_groups)), #5256)"),
    targets={
        "deepspeed.runtime.zero.stage3": patch_stage3,
        "deepspeed.runtime.zero.stage_1_and_2": patch_stage12,
    },
    check_config=check_config,
)
