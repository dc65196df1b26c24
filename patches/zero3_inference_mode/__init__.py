"""Gather ZeRO-3 parameters as normal tensors inside ``torch.inference_mode()``, so that training can follow it.

Symptom
    ``RuntimeError: Inference tensors cannot be saved for backward`` (the
    rest of the message depends on the torch release) in the first training
    forward under ZeRO-3 after a forward
    run inside ``torch.inference_mode()``: an evaluation loop decorated with
    it, or RL code computing old/reference log-probabilities or generating
    with it (ms-swift #3237 and #3239 for GRPO on DeepSpeed 0.14.5, TRL
    #2953 on 0.16.4, snowflakedb/ArcticTraining#265 "when mixing train+eval
    with zero3 enabled").  ZeRO-1/2 and a run
    without ZeRO-3 are not affected; the frameworks' fix was to use
    ``torch.no_grad()`` instead (TRL #2987, ms-swift #3324; ms-swift's
    ``stage3_prefetch_bucket_size: 0`` does not help on its own: tested).
    Before the first step, with DeepSpeed's default persistence threshold,
    a few evaluations alone are enough (``eval_on_start``, a generation).

Cause
    A ZeRO-3 parameter's full data is gathered when its module runs (the
    coordinator's ``fetch_sub_module``), or when another module reads it by
    attribute (``Init._all_gather``), into tensors made there.  Inside
    ``torch.inference_mode()`` those are inference tensors.  The coordinator
    keeps parameters gathered past their module where they are reused soon
    (``stage3_max_reuse_distance``), prefetched or persistent
    (``stage3_param_persistence_threshold``; before the first step a
    forward that records the module trace releases those too, and the next
    one gathers them again): after the evaluation they are still
    ``AVAILABLE``, and the next training forward uses their data as it is.
    Autograd refuses to save an inference tensor for backward.

Affected versions
    Gated on every release (ZeRO-3 on 2 or more ranks): no release was seen
    to handle it, and nothing in 0.19.8's ZeRO-3 code looks at inference
    mode.  Reproduced on DeepSpeed 0.14.1, 0.19.2 and 0.19.8 (CPU) with
    ``stage3_param_persistence_threshold`` 0 and with the default and layers
    above it; on 0.19.2 and 0.19.8 also with ``engine.eval()`` around the
    evaluation, and with the default threshold and evaluations before the
    first step (0.14.1 trains those two: it releases everything after an
    evaluation in eval mode, and gathers its persistent parameters outside
    the evaluations).  On one rank without parameter offload a
    gather is a view of the rank's own partition, a normal tensor (read, not
    run).

Flag
    ``ZEROSHIM_ZERO3_INFERENCE_MODE=auto|on|off`` (default ``auto``).

Fix
    ``PartitionedParameterCoordinator.fetch_sub_module`` and
    ``Init._all_gather`` (a parameter read by attribute outside its module,
    ``param.item()``, ``GatheredParameters``) are wrapped: where inference
    mode is on when they are called, they run with inference mode off (and
    grad off, as DeepSpeed's own ``torch.no_grad()`` decorator has it), so
    the parameters they gather and prefetch are normal tensors.  The same
    all-gathers run, into the same amount of memory, with the same values:
    the evaluation's outputs and the training after it are those of the same
    loop under ``torch.no_grad()``, bit for bit.  Outside inference mode a
    fetch or gather costs one check.  Only the error goes; said once per job
    at INFO.  An engine that only ever evaluates (a reference model) gets
    normal tensors too, with the same values.

    Not covered: the secondary partitions of hpZ
    (``zero_hpz_partition_size``), made when a parameter is released inside
    inference mode, stay inference tensors (read, not run: fetches only read
    them).

Undo
    ``zeroshim.unpatch("zero3_inference_mode")`` restores
    ``PartitionedParameterCoordinator.fetch_sub_module`` and
    ``Init._all_gather``.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero3_inference_mode``.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params

NAME = "zero3_inference_mode"
#: fetches / gathers: coordinator fetches and Init._all_gather calls run with inference mode off because it was on
stats = {"fetches": 0, "gathers": 0}
# torch.is_inference_mode_enabled, bound when the patch is applied (the check runs on every module fetch)
_inference_mode_enabled = None


def _outside(call, counter: str, args, kwargs):
    """Inference mode is on: run ``call`` with it (and grad) off, if the patch is active."""
    act = False
    with guard(NAME):
        act = is_active(NAME)
        if act:
            stats[counter] += 1
            _log.acted(NAME, "gathered ZeRO-3 parameters inside torch.inference_mode() as normal tensors (the "
                             "same values)", "ZeRO-3 keeps some gathered after that forward, and as inference "
                             "tensors they would make a training forward after it fail")
    if not act:
        return call(*args, **kwargs)
    import torch

    with torch.inference_mode(False), torch.no_grad():
        return call(*args, **kwargs)


def _outside_inference_mode(counter: str):
    """A wrapt wrapper that runs its target with inference mode (and grad) off where inference mode is on."""
    def wrapper(wrapped, instance, args, kwargs):
        if not _inference_mode_enabled():  # one check
            return wrapped(*args, **kwargs)
        return _outside(wrapped, counter, args, kwargs)

    return wrapper


def _fetch_replacement(original):
    """The same as a plain function in place of ``fetch_sub_module`` (``Patcher.wrap_hot``): it runs on every
    module fetch, about 850 a step on a 32-layer model (benchmarks/RESULTS.md section 57)."""
    from zeroshim import _timing

    call = _timing.original(original)  # benchmark mode: DeepSpeed's time is not zeroshim's

    def fetch_sub_module(self, *args, **kwargs):
        if not _inference_mode_enabled():  # every fetch of a training step: one check
            return call(self, *args, **kwargs)
        return _outside(call, "fetches", (self,) + args, kwargs)

    fetch_sub_module.__qualname__ = getattr(original, "__qualname__", "fetch_sub_module")
    fetch_sub_module.__doc__ = getattr(original, "__doc__", None)
    return fetch_sub_module


_fetch_sub_module = _outside_inference_mode("fetches")
_all_gather = _outside_inference_mode("gathers")


def _bind() -> None:
    global _inference_mode_enabled
    import torch

    _inference_mode_enabled = require_attr(torch, "is_inference_mode_enabled")


def patch_coordinator(module, patcher: Patcher) -> None:
    _bind()
    cls = require_attr(module, "PartitionedParameterCoordinator")
    require_params(require_attr(cls, "fetch_sub_module"), "current_submodule", "forward")
    patcher.wrap_hot(cls, "fetch_sub_module", _fetch_sub_module, _fetch_replacement)


def patch_partition_parameters(module, patcher: Patcher) -> None:
    _bind()
    cls = require_attr(module, "Init")
    require_params(require_attr(cls, "_all_gather"), "param_list")
    patcher.wrap(cls, "_all_gather", _all_gather)


PATCH = Patch(
    changes=("error",),
    name=NAME,
    summary="ZeRO-3 training after a forward inside torch.inference_mode() (evaluation, RL log-probs): "
            "\"Inference tensors cannot be saved for backward\"",
    signatures=((r"RuntimeError: Inference tensors cannot be saved for backward", r"(?i)deepspeed|zero"),),
    affects={"deepspeed": ""},
    versions_note="ZeRO-3",
    targets={"deepspeed.runtime.zero.partitioned_param_coordinator": patch_coordinator,
             "deepspeed.runtime.zero.partition_parameters": patch_partition_parameters},
)
