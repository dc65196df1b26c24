"""Re-record ZeRO-3's parameter trace when hooks are registered again on the whole model (after generation).

Symptom
    ``IndexError: pop from an empty deque`` in
    ``PartitionedParameterCoordinator.record_parameters`` (from ``reset_step``,
    at the end of a training step) under ZeRO-3, in a loop that generates
    between training steps through an "unwrap for generation" helper:
    DeepSpeed's own ``deepspeed.runtime.zero.stage3.unwrap_model_for_generation``
    or TRL's (GRPO, RLOO, PPO, online DPO), which gather the parameters, remove
    ZeRO-3's module hooks for the generation and register them again after.
    Seen with a peft LoRA model; a plain model can train on.

Cause
    Registering the hooks again numbers every module again (``ds_id``, counted
    on from a default argument ``count=[0]`` that is never reset), while the
    parameter coordinator keeps the trace it is recording: for each module
    number, a queue of the steps it was fetched at.  Since DeepSpeed 0.15.4
    (#6662: one coordinator for training and inference) the trace starts
    invalid and the first step leaves it recording, so a generation after it
    finds a trace being recorded, its entries filed under the old numbers.
    At the end of the next step the coordinator reads them under the new
    numbers (on 0.16.9, filed under 74, 76, ... and read under 148, 150, ...),
    and a queue is empty.
    DeepSpeed 0.19.2 (#8043) invalidates the trace when the root module is
    registered again, so the next pass records it afresh, and clears the
    fetch-step queues with the rest of the trace.

Affected versions
    DeepSpeed 0.15.4 to 0.19.1, read from the released sdists: 0.15.4, 0.17.6,
    0.18.9, 0.19.0 and 0.19.1 start the trace invalid and keep it when the
    hooks are registered again; 0.19.2 invalidates it.  0.9.5 to 0.15.3
    number the modules the same way, but start the trace recording and
    complete it in the first step; a complete trace follows the modules
    themselves, not their numbers, and the same loop trains on 0.14.1.
    Reproduced on 0.16.9 and 0.19.1.  The source fingerprint: a trace that
    starts invalid, and no fetch-step queues in ``_clear_trace_structures``.

Flag
    ``ZEROSHIM_ZERO3_TRACE_REHOOK=auto|on|off`` (default ``auto``).

Fix
    What DeepSpeed 0.19.2 does: the hook registration
    (``_register_deepspeed_module``; ``_register_hooks_recursively`` in 0.15)
    is wrapped so that registering the root module again invalidates the
    coordinator's trace where it is not invalid already, and the
    coordinator's ``_clear_trace_structures`` also empties its fetch-step
    queues.  The first registration, when the engine is built, finds the
    trace invalid and changes nothing.  When it acts, the next training pass
    runs without prefetching and the one after records the trace again, with
    the collectives recording runs (the ranks compare the recorded order);
    the numbers are the same.  One WARNING per job.

Undo
    ``zeroshim.unpatch("zero3_trace_rehook")`` restores both methods.

Evidence
    ``benchmarks/RESULTS.md``, section 17.
"""

from __future__ import annotations

import collections

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, TargetChanged, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "zero3_trace_rehook"
#: acted: traces invalidated because the root module's hooks were registered again
stats = {"acted": 0}
_QUEUES = "_PartitionedParameterCoordinator__step_id_module_fetched_for"
_REGISTER = ("_register_deepspeed_module", "_register_hooks_recursively")  # the latter: 0.15.4 and 0.15.x


def _register(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeRoOffload._register_deepspeed_module(module, count=[0])`` (it recurses through this
    wrapper for every child; only the root module counts)."""
    module = args[0] if args else kwargs.get("module")
    if module is not None and module is getattr(instance, "module", None) and is_active(NAME):
        with guard(NAME):
            coordinator = instance.get_param_coordinator()
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
                stats["acted"] += 1
                _log.acted(NAME, "re-recording ZeRO-3's parameter trace after the model's hooks were registered "
                                 "again (the next pass runs without prefetching)",
                           "registering the hooks again renumbers the modules under the recorded trace, and "
                           "DeepSpeed %s keeps it (IndexError: pop from an empty deque; fixed in 0.19.2)",
                           _versions.shown("deepspeed"))
    return wrapped(*args, **kwargs)


def _clear(wrapped, instance, args, kwargs):
    """Wraps ``PartitionedParameterCoordinator._clear_trace_structures()``: the fetch-step queues go with the
    rest of the trace."""
    result = wrapped(*args, **kwargs)
    if is_active(NAME) and hasattr(instance, _QUEUES):
        setattr(instance, _QUEUES, collections.defaultdict(collections.deque))
    return result


def patch_offload(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedZeRoOffload")
    require_attr(cls, "get_param_coordinator")
    names = [name for name in _REGISTER if hasattr(cls, name)]
    if not names:
        raise TargetChanged(f"DeepSpeedZeRoOffload has none of {', '.join(_REGISTER)}")
    patcher.wrap(cls, names[0], _register)


def patch_coordinator(module, patcher: Patcher) -> None:
    cls = require_attr(module, "PartitionedParameterCoordinator")
    for name in ("_clear_trace_structures", "_invalidate_trace", "is_invalid_trace", "record_parameters"):
        require_attr(cls, name)
    patcher.wrap(cls, "_clear_trace_structures", _clear)


PATCH = Patch(
    changes=("collectives",),
    name=NAME,
    summary="ZeRO-3 training after generate() through an unwrap-for-generation helper (TRL GRPO/RLOO/PPO, "
            "DeepSpeed's own): IndexError: pop from an empty deque in record_parameters",
    signatures=(r"IndexError: pop from an empty deque",),
    affects={"deepspeed": ">=0.15.4,<0.19.2"},
    versions_note="ZeRO-3",
    fingerprint=Fingerprint("deepspeed.runtime.zero.partitioned_param_coordinator",
                            # the trace starts invalid (#6662) and _clear_trace_structures keeps the fetch-step
                            # queues (#8043 resets them there)
                            r"\A(?=[\s\S]*self\.__trace_mode: ZeRoTraceMode = ZeRoTraceMode\.INVALID\n)"
                            r"(?![\s\S]*def _clear_trace_structures\(self\)[^\n]*\n(?:[^\n]*\n){0,10}?"
                            r"[ \t]*self\.__step_id_module_fetched_for = )",
                            "a trace that starts invalid, and _clear_trace_structures without the fetch-step queues"),
    targets={"deepspeed.runtime.zero.parameter_offload": patch_offload,
             "deepspeed.runtime.zero.partitioned_param_coordinator": patch_coordinator},
)
