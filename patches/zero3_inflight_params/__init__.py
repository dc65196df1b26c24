"""Finish and release ZeRO-3 prefetches the step did not use, instead of "still have inflight params".

Symptom
    ``RuntimeError: still have inflight params [{'id': ..., 'status': ...}]``
    at the end of a ZeRO-3 step (in ``reset_step``: after ``backward`` in
    training, at the end of a ``no_grad`` forward in evaluation), from the
    second or third step on, when the modules a step runs are not those of
    the step before: a branch taken on some steps only, a tower that runs for
    some batches only (multimodal models), an evaluation between training
    steps that runs other modules (deepspeedai/DeepSpeed#5828, #5648,
    OpenRLHF#312, LLaMA-Factory#2230).  The same leftover makes
    ``engine.empty_partition_cache()`` in mid-pass (RLHF loops that free
    memory between phases) fail with ``RuntimeError: param {...} still in
    flight``.

Cause
    After one complete pass ZeRO-3 keeps the pass's module trace and, while
    running a module, prefetches (starts all-gathers for) the parameters of
    the modules the trace says come next; the gathers in flight are kept in
    the coordinator's ``InflightParamRegistry`` and are waited for when their
    module runs.  When a step runs other modules than the trace,
    ``trace_prologue`` invalidates the trace, but the prefetches already
    started for the modules that do not run stay in the registry: nothing
    waits for them.  ``PartitionedParameterCoordinator.reset_step`` then
    raises if the registry is not empty, and ``release_and_reset_all``
    raises for a module parameter still in it.  No data is wrong: a
    prefetch only copies shards into a full parameter.

Affected versions
    DeepSpeed < 0.15.3, read from the released sdists: 0.14.1 and 0.15.2 raise
    in ``reset_step`` and ``release_and_reset_all``; 0.15.3 (#6557) gives the
    coordinator ``_clean_inflight_param_registry`` (wait for each handle,
    release the parameter), called in ``reset_step`` and ``_invalidate_trace``,
    and waits instead of raising in ``release_and_reset_all``; 0.16.9 has the
    same.  The raise in ``reset_step`` dates from 2022 (#1453); releases older
    than 0.14.1 were not run.  The raise's message is the source fingerprint.

Flag
    ``ZEROSHIM_ZERO3_INFLIGHT_PARAMS=auto|on|off`` (default ``auto``).

Fix
    ``PartitionedParameterCoordinator.reset_step`` and ``_invalidate_trace``
    are wrapped: where the coordinator's registry still holds parameters
    (before ``reset_step``, after ``_invalidate_trace``), each one's gather is
    waited for and the parameter is released through the coordinator's own
    release (re-partitioned unless a running module still uses it), and the
    registry is emptied.  ``release_and_reset_all(module)`` is wrapped to
    wait first for the gathers still in flight for ``module``'s parameters,
    which it then releases as usual.  An empty registry (every step that runs
    the modules of its trace) is left alone, so such runs are unchanged.  One
    INFO line per job, by the first rank that acts.

Undo
    ``zeroshim.unpatch("zero3_inflight_params")`` restores the three methods.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero3_inflight_params``.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "zero3_inflight_params"
#: the coordinator's private attributes (name-mangled ``__inflight_param_registry`` / ``__release_param``)
REGISTRY = "_PartitionedParameterCoordinator__inflight_param_registry"
RELEASE = "_PartitionedParameterCoordinator__release_param"
#: parameters whose stale gather the patch waited for: at ``reset_step``, after ``_invalidate_trace``, in
#: ``release_and_reset_all``
stats = {"reset_step": 0, "invalidate": 0, "release_all": 0}


def _said(where: str) -> None:
    _log.acted(NAME, "waited for and released ZeRO-3 parameters still being gathered for modules this step did "
               "not run (%s)", "DeepSpeed < 0.15.3 raises \"still have inflight params\" there", where)


def _drain(coordinator, where: str) -> None:
    """Wait for every gather in ``coordinator``'s registry and release its parameter (the coordinator's own
    release: only an available parameter that no running module uses is re-partitioned)."""
    registry = getattr(coordinator, REGISTRY, None)
    release = getattr(coordinator, RELEASE, None)
    if not registry or release is None:
        return
    stale = list(registry.items())
    registry.clear()
    for param, handle in stale:
        handle.wait()  # one handle may serve several parameters: a second wait returns at once
        release(param)
    stats[where] += len(stale)
    _said(where)


def _reset_step(wrapped, instance, args, kwargs):
    """Wraps ``PartitionedParameterCoordinator.reset_step()``."""
    with guard(NAME):
        if instance is not None and is_active(NAME):
            _drain(instance, "reset_step")
    return wrapped(*args, **kwargs)


def _invalidate_trace(wrapped, instance, args, kwargs):
    """Wraps ``PartitionedParameterCoordinator._invalidate_trace()``."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        if instance is not None and is_active(NAME):
            _drain(instance, "invalidate")
    return result


def _release_and_reset_all(wrapped, instance, args, kwargs):
    """Wraps ``PartitionedParameterCoordinator.release_and_reset_all(module)``."""
    with guard(NAME):
        module = args[0] if args else kwargs.get("module")
        registry = getattr(instance, REGISTRY, None) if instance is not None else None
        if registry and module is not None and is_active(NAME):
            # ``iter_params`` of the module's own file: its parameters and its external ones, as the method does
            from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

            mine = [p for p in iter_params(module, recurse=True) if p in registry]
            for param in mine:
                registry.pop(param).wait()
            if mine:
                stats["release_all"] += len(mine)
                _said("release_and_reset_all")
    return wrapped(*args, **kwargs)


def patch_coordinator(module, patcher: Patcher) -> None:
    cls = require_attr(module, "PartitionedParameterCoordinator")
    require_attr(module, "iter_params")
    require_attr(cls, RELEASE)
    for method in ("reset_step", "_invalidate_trace", "release_and_reset_all"):
        require_attr(cls, method)
    patcher.wrap(cls, "reset_step", _reset_step)
    patcher.wrap(cls, "_invalidate_trace", _invalidate_trace)
    patcher.wrap(cls, "release_and_reset_all", _release_and_reset_all)


PATCH = Patch(
    changes=('error', 'collectives'),
    name=NAME,
    summary="ZeRO-3 \"still have inflight params\" when the modules run change between steps (branches, towers, "
            "eval between steps): prefetched gathers of modules that did not run are never waited for",
    signatures=(r"RuntimeError: still have inflight params", r"RuntimeError: param \{'id': \d+.*\} still in flight"),
    affects={"deepspeed": "<0.15.3"},
    fingerprint=Fingerprint("deepspeed.runtime.zero.partitioned_param_coordinator",
                            r"raise RuntimeError\(f\"still have inflight params",
                            "the raise of PartitionedParameterCoordinator.reset_step (removed by #6557)"),
    targets={"deepspeed.runtime.zero.partitioned_param_coordinator": patch_coordinator},
)
