"""Gather ZeRO-3 parameters as normal tensors inside ``torch.inference_mode()``, so that training can follow it.

Symptom
    ``RuntimeError: Inference tensors cannot be saved for backward. To work
    around you can make a clone to get a normal tensor and use it in
    autograd.`` in the first training forward under ZeRO-3 after a forward
    run inside ``torch.inference_mode()``: an evaluation loop decorated with
    it, or RL code computing old/reference log-probabilities or generating
    with it (ms-swift #3237 and #3239 for GRPO on DeepSpeed 0.14.5, TRL
    #2953 on 0.16.4, snowflakedb/ArcticTraining#265 "when mixing train+eval
    with zero3 enabled").  ZeRO-1/2 and a run
    without ZeRO-3 are not affected; the frameworks' fix was to use
    ``torch.no_grad()`` instead (TRL #2987, ms-swift #3324; ms-swift's
    ``stage3_prefetch_bucket_size: 0`` does not help on its own: tested).

Cause
    A ZeRO-3 parameter's full data is gathered by the coordinator's
    ``fetch_sub_module`` when its module runs, into tensors made there.
    Inside ``torch.inference_mode()`` those are inference tensors.  The
    coordinator keeps parameters gathered past their module where they are
    reused soon (``stage3_max_reuse_distance``) or prefetched: after the
    evaluation they are still ``AVAILABLE``, and the next training forward
    uses their data as it is.  Autograd refuses to save an inference tensor
    for backward.  (Persistent parameters, ``stage3_param_persistence_threshold``,
    are gathered once, outside any forward: not affected.)

Affected versions
    Every ZeRO-3 release: reproduced on DeepSpeed 0.14.1, 0.19.2 and 0.19.8
    (CPU, 2 ranks; ``stage3_param_persistence_threshold`` 0, and the default
    with a layer above it).  No upstream fix: nothing in
    DeepSpeed's ZeRO-3 code looks at inference mode (read in 0.19.8).

Flag
    ``ZEROSHIM_ZERO3_INFERENCE_MODE=auto|on|off`` (default ``auto``).

Fix
    ``PartitionedParameterCoordinator.fetch_sub_module`` is wrapped: where
    inference mode is on when it is called, it runs with inference mode off
    (and grad off, as DeepSpeed's own ``torch.no_grad()`` decorator has it),
    so the parameters it gathers and prefetches are normal tensors.  The same
    all-gathers run, into the same amount of memory, with the same values:
    the evaluation's outputs and the training after it are those of the same
    loop under ``torch.no_grad()``, bit for bit.  A fetch outside inference
    mode (every training step) costs one check.  Only the error goes; said
    once per job at INFO.

    Not covered: ``deepspeed.zero.GatheredParameters`` entered inside
    inference mode gathers outside the coordinator; it releases what it
    gathered at its exit, so nothing it made outlives it.

Undo
    ``zeroshim.unpatch("zero3_inference_mode")`` restores
    ``PartitionedParameterCoordinator.fetch_sub_module``.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero3_inference_mode``.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params

NAME = "zero3_inference_mode"
#: fetches: ZeRO-3 fetches run with inference mode off because it was on
stats = {"fetches": 0}


def _fetch_sub_module(wrapped, instance, args, kwargs):
    """Wraps ``PartitionedParameterCoordinator.fetch_sub_module(current_submodule, forward)``."""
    import torch

    if not torch.is_inference_mode_enabled():  # every training step: one check
        return wrapped(*args, **kwargs)
    act = False
    with guard(NAME):
        act = is_active(NAME)
        if act:
            stats["fetches"] += 1
            _log.acted(NAME, "gathered ZeRO-3 parameters inside torch.inference_mode() as normal tensors (the "
                             "same values)", "parameters ZeRO-3 keeps gathered after the inference forward would "
                             "stay inference tensors and make the next training forward fail")
    if not act:
        return wrapped(*args, **kwargs)
    with torch.inference_mode(False), torch.no_grad():
        return wrapped(*args, **kwargs)


def patch_coordinator(module, patcher: Patcher) -> None:
    cls = require_attr(module, "PartitionedParameterCoordinator")
    require_params(require_attr(cls, "fetch_sub_module"), "current_submodule", "forward")
    patcher.wrap(cls, "fetch_sub_module", _fetch_sub_module)


PATCH = Patch(
    changes=("error",),
    name=NAME,
    summary="ZeRO-3 training after a forward inside torch.inference_mode() (evaluation, RL log-probs): "
            "\"Inference tensors cannot be saved for backward\"",
    signatures=((r"RuntimeError: Inference tensors cannot be saved for backward", r"(?i)deepspeed|zero"),),
    affects={"deepspeed": ""},
    versions_note="ZeRO-3",
    targets={"deepspeed.runtime.zero.partitioned_param_coordinator": patch_coordinator},
)
