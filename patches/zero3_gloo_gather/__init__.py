"""Wait for every all-gather of a blocking ZeRO-3 gather on gloo, not only the last one.

Symptom
    Silent: under ZeRO-3 on a gloo process group (CPU training, DeepSpeed's
    own multi-rank CPU tests, any run with ``dist_backend="gloo"``), a
    parameter read inside ``deepspeed.zero.GatheredParameters`` over several
    parameters now and then holds uninitialised memory or another tensor's
    values instead of its own (``-3.5e13``, denormals, NaN, or a plausible
    ``0.04`` for ``0.07``).  Nothing is raised.  Where the gather has
    ``modifier_rank=0`` -- the consolidated state dict of
    ``save_16bit_model`` and of Trainer's ZeRO-3 save, ``from_pretrained``'s
    ZeRO-3 load -- its exit broadcasts rank 0's half-written copy into every
    rank's shard, so the saved file is wrong *and* the model being trained
    changes, or a late all-gather overwrites freshly loaded weights
    (deepspeedai/DeepSpeed#8539).  Ordinary training takes the same gather
    after every optimizer step for its persistent parameters (with the
    default ``stage3_param_persistence_threshold`` every parameter under 1e5
    elements): a 30-step run of 24 Linear(64) + LayerNorm pairs ended at
    another loss than the same run with nothing persistent in 1 of 3 runs.

Cause
    ``Init._allgather_params_coalesced`` (the blocking path of
    ``_all_gather``, taken for two or more parameters) launches one async
    all-gather per parameter into ``torch.empty`` buffers, waits on the last
    handle only, points each ``param.data`` at its buffer and calls
    ``get_accelerator().synchronize()``.  On CUDA/NCCL the all-gathers run in
    order on one stream and the synchronize covers them all.  On gloo each
    async work runs on the process group's worker threads, in no order
    relative to the others, and the CPU accelerator's ``synchronize()`` does
    nothing: waiting on the last handle says nothing about the earlier ones,
    so the caller can read a buffer before its all-gather has written it.

Affected versions
    DeepSpeed < 0.19.8 with a gloo process group, read from the released
    sdists: 0.14.1, 0.16.9, 0.19.2, 0.19.3, 0.19.4, 0.19.5, 0.19.6 and 0.19.7
    wait on ``launch_handles[-1]`` only; 0.19.8 waits on every handle
    (#8539).  The code dates from 2021 (#1188).  The source fingerprint is
    the line ``launch_handles[-1].wait()``.  NCCL (and other backends whose
    collectives complete in launch order) is not affected and is left alone.

Flag
    ``ZEROSHIM_ZERO3_GLOO_GATHER=auto|on|off`` (default ``auto``).

Fix
    ``Init._allgather_params_coalesced`` is wrapped: when its process group
    is gloo and it is given two or more parameters, DeepSpeed's own
    ``_allgather_params_coalesced`` is called once per parameter, so the
    handle it waits on is that parameter's only one.  Every rank issues the
    same all-gathers in the same order as before (the order of the
    parameters), so ranks need not agree on anything; only the overlap of
    one parameter's all-gather with the next is given up, on gloo.  One WARNING
    per job, by the first rank that acts.  Cost, on gloo only: the gathers of several parameters lose their
    overlap.
    Training steps take this path once per optimizer step where two or more
    parameters are persistent (``_post_step`` gathers them;
    ``stage3_param_persistence_threshold``, default 1e5 elements, makes
    every small parameter persistent); their prefetching gathers use
    ``all_gather_coalesced`` (one all-gather per bucket) and are not wrapped.

Undo
    ``zeroshim.unpatch("zero3_gloo_gather")`` restores
    ``Init._allgather_params_coalesced``.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero3_gloo_gather``.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "zero3_gloo_gather"
#: split: blocking gathers of several parameters on gloo run one parameter at a time
stats = {"split": 0}


def _on_gloo(init, params) -> bool:
    import torch.distributed as dist

    group_of = getattr(init, "get_partition_dp_group", None)
    group = group_of(params[0]) if callable(group_of) else getattr(init, "ds_process_group", None)
    return dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "gloo"


def _bind(param_list, hierarchy=0, quantize=False):
    return param_list, hierarchy, quantize


def _allgather_params_coalesced(wrapped, instance, args, kwargs):
    """Wraps ``Init._allgather_params_coalesced(param_list, hierarchy=0, quantize=False)``."""
    split = None
    with guard(NAME):
        params, hierarchy, quantize = _bind(*args, **kwargs)
        many = isinstance(params, (list, tuple)) and len(params) > 1  # DeepSpeed passes lists
        if many and is_active(NAME) and getattr(instance, "num_partitions", 1) > 1 and _on_gloo(instance, params):
            split = params
            stats["split"] += 1
            _log.acted(NAME, "ZeRO-3 gathers of several parameters on gloo wait for each parameter's all-gather",
                       "DeepSpeed < 0.19.8 waits on the last one only and can read unwritten memory")
    if split is None:
        return wrapped(*args, **kwargs)
    for param in split:
        wrapped([param], hierarchy, quantize=quantize)
    return None


def patch_partition_parameters(module, patcher: Patcher) -> None:
    cls = require_attr(module, "Init")
    require_params(require_attr(cls, "_allgather_params_coalesced"), "param_list", "hierarchy", "quantize")
    patcher.wrap(cls, "_allgather_params_coalesced", _allgather_params_coalesced)


PATCH = Patch(
    changes=('collectives',),
    on_disagreement="stop",  # without it gloo's coalesced gathers read unwritten memory, silently
    name=NAME,
    summary="ZeRO-3 on gloo (CPU): GatheredParameters over several parameters, save_16bit_model and ZeRO-3 loads "
            "now and then read unwritten memory; with modifier_rank=0 the model itself changes, silently",
    signatures=(),
    versions_note="with a gloo process group; NCCL untouched",
    affects={"deepspeed": "<0.19.8"},
    fingerprint=Fingerprint("deepspeed.runtime.zero.partition_parameters", r"launch_handles\[-1\]\.wait\(\)",
                            "the wait on the last all-gather handle only in _allgather_params_coalesced (#8539)"),
    targets={"deepspeed.runtime.zero.partition_parameters": patch_partition_parameters},
)
