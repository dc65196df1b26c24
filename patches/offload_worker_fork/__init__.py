"""Keep DataLoader workers from copying the offloaded optimizer state (host OOM in epoch 2).

Symptom
    ZeRO with ``offload_optimizer`` (and ZeRO-3 ``offload_param``) on the CPU
    and DataLoader worker processes (``num_workers > 0``; HF Trainer's
    ``dataloader_num_workers``): host memory climbs at every epoch boundary
    and the job is OOM-killed early in epoch 2, while GPU memory is fine.
    Reported with a 34B model (XTuner, ZeRO-3 offload); more nodes (smaller
    shards) or LoRA (less optimizer state) avoid it.

Cause
    Each epoch a non-persistent DataLoader forks new worker processes.  A
    forked child shares the parent's whole address space copy-on-write.  The
    parent then rewrites its offloaded fp32 master weights, Adam states,
    gradient buffers and (ZeRO-3) parameter partitions in place at every
    step, so each rewritten page is copied once per worker generation: the
    workers keep the old pages alive, the parent gets new ones.  Adam's states
    exist only after the first step, so epoch 2's workers pin more than
    epoch 1's: "OOM early in epoch 2", growing with the offloaded state
    (about 12-18 bytes per parameter per rank).  Per-process RSS and USS hide
    it (the copies are shared by the workers of one rank); system-wide use
    (MemTotal - MemAvailable) and PSS summed over a rank and its workers show
    it.  Measured in ``benchmarks/epoch_memory.py`` (``benchmarks/RESULTS.md``).

Affected versions
    Every DeepSpeed release with CPU offload (nothing upstream keeps workers
    from sharing the offloaded buffers), on a platform where DataLoader
    workers are forked (Linux; Python < 3.14 defaults to ``fork``).  Checked
    on 0.14.1, 0.16.9, 0.19.2 and 0.19.8.

Flag
    ``ZEROSHIM_OFFLOAD_WORKER_FORK=auto|on|off`` (default ``auto``).

Fix
    ``torch.utils.data.dataloader._MultiProcessingDataLoaderIter.__init__``
    (where every DataLoader starts its workers: a custom loop's torch
    DataLoader, DeepSpeedDataLoader, HF Trainer's and accelerate's loaders)
    is wrapped.  When the workers are about to be *forked* while a ZeRO engine
    with CPU-resident optimizer state is alive, the interior pages of that
    engine's large CPU buffers (each storage of at least 1 MiB held by the
    ZeRO optimizer, its inner optimizer's state and parameter groups, and the
    ZeRO-3 parameter partitions; never the model's own parameters, which a
    dataset may use) are marked ``MADV_DONTFORK`` (Linux
    ``madvise``); the workers are started; the pages are marked
    ``MADV_DOFORK`` again.  The workers then simply do not have those pages:
    nothing is shared, nothing is copied.  Every other fork (the user's own
    ``multiprocessing``, ``subprocess``, persistent workers started later)
    is left as it is.

    Why this and not the alternatives (measured, numbers in RESULTS.md):
    persistent workers started before the optimizer state exists still copy
    the fp32 master weights and parameter partitions written in epoch 1; a
    ``forkserver``/``spawn`` context re-imports the user's ``__main__`` in
    every worker (an unguarded script re-runs its training code: it hangs)
    and needs a picklable dataset; ``malloc_trim`` and ``gc`` do not touch
    pages a child still maps.

    Safety: a worker never reads the optimizer state (it runs the dataset and
    the collate function).  Only whole pages strictly inside each buffer are
    marked (the first and last 64 bytes and their pages are not), so the
    allocator's chunk headers stay in the child and freeing such a tensor in
    a worker, if it ever happened, does not touch a missing page.  The marks
    are removed right after the fork, so they never outlive it.  Nothing
    changes numerically (tested bit for bit).

    Not covered: ``persistent_workers=True`` loaders created before the engine
    (their workers already exist), and NVMe offload's swap buffers (small,
    pinned, rewritten from disk).

Undo
    ``zeroshim.unpatch("offload_worker_fork")`` restores
    ``_MultiProcessingDataLoaderIter.__init__`` (and releases engine tracking).
"""

from __future__ import annotations

import sys

from zeroshim import _engines, _log, _memory
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr

NAME = "offload_worker_fork"
MIN_BYTES = 1 << 20  # buffers smaller than this are not worth a madvise call
_EDGE = 64           # bytes kept forkable at each end of a buffer (allocator headers)
MADV_DOFORK, MADV_DONTFORK = 11, 10  # <asm-generic/mman-common.h>

#: counts since import (introspection and tests)
stats = {"forks": 0, "buffers": 0, "bytes": 0, "madvise_errors": 0, "trimmed": 0}
_libc: dict = {}


# -- which memory -----------------------------------------------------------------------
def _tensors(obj, depth: int = 0):
    """Tensors in ``obj``: a tensor (and its ``.grad``: ZeRO-3 offload keeps the
    fp32 gradient partition there), or lists/tuples/dicts/dataclasses of them
    (3 levels; DeepSpeed keeps its reduce buckets in dataclasses)."""
    import dataclasses

    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
        grad = obj.grad if obj.is_leaf else None
        if grad is not None:
            yield grad
    elif depth >= 3:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for item in vars(obj).values():
            yield from _tensors(item, depth + 1)


def offloaded_buffers(engine) -> "dict":
    """``{storage address: size in bytes}`` of the engine's CPU buffers of at
    least :data:`MIN_BYTES`: what the ZeRO optimizer holds (its attributes),
    its inner optimizer's state and parameter groups, and the ZeRO-3
    parameter partitions (``ds_tensor``)."""
    found = {}
    sources = []
    zero = getattr(engine, "optimizer", None)
    if zero is not None:
        sources.append(list(vars(zero).values()))
        inner = getattr(zero, "optimizer", None)
        if inner is not None and hasattr(inner, "state"):
            sources.append(list(inner.state.values()))
            sources.append([group.get("params", ()) for group in getattr(inner, "param_groups", ())])
    module = getattr(engine, "module", None)
    usable = set()  # the model's own parameters stay: a dataset may run the model in a worker
    if module is not None:
        sources.append([getattr(p, "ds_tensor", None) for p in module.parameters()])
        usable = {_address(p) for p in module.parameters()}
    for source in sources:
        for tensor in _tensors(source):
            if tensor.device.type != "cpu":
                continue
            address = _address(tensor)
            if address is None or address in usable:
                continue
            size = tensor.untyped_storage().nbytes()
            if size >= MIN_BYTES:
                found[address] = max(size, found.get(address, 0))
    return found


def _address(tensor):
    try:
        return tensor.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):  # meta, sparse, ...
        return None


def _interior_pages(address: int, size: int, page: int):
    """The page-aligned range strictly inside ``[address, address + size)``,
    keeping :data:`_EDGE` bytes (and their pages) at each end; None if empty."""
    start = (address + _EDGE + page - 1) // page * page
    end = (address + size - _EDGE) // page * page
    return (start, end - start) if end > start else None


def _madvise(ranges, advice: int) -> int:
    libc = _libc.get("libc")
    done = 0
    for start, length in ranges:
        if libc.madvise(start, length, advice) == 0:
            done += 1
        else:
            stats["madvise_errors"] += 1
    return done


def _engines_with_cpu_state() -> list:
    return [engine for engine in _engines.live(1) if offloaded_buffers(engine)]


def _forks(loader) -> bool:
    """Will this DataLoader's workers be forked?"""
    import multiprocessing

    context = getattr(loader, "multiprocessing_context", None)
    if context is None:
        context = multiprocessing.get_context()
    method = context if isinstance(context, str) else getattr(context, "get_start_method", lambda: None)()
    return method == "fork"


# -- wrapper ----------------------------------------------------------------------------
def _iterator_init(wrapped, instance, args, kwargs):
    """Wraps ``_MultiProcessingDataLoaderIter.__init__(loader)``: start the workers
    with the offloaded buffers' pages out of their address space."""
    ranges = []
    with guard(NAME):
        loader = args[0] if args else kwargs.get("loader")
        if is_active(NAME) and _engines.live(1) and loader is not None and _forks(loader):
            import mmap

            buffers = {}
            for engine in _engines.live(1):
                buffers.update(offloaded_buffers(engine))
            ranges = [r for r in (_interior_pages(a, n, mmap.PAGESIZE) for a, n in buffers.items()) if r]
            marked = _madvise(ranges, MADV_DONTFORK)
            # Freed heap the parent will reuse (gathered parameters, activations) would be shared too:
            # returned to the OS, those pages are in neither process until the parent writes them again.
            stats["trimmed"] += bool(_memory.malloc_trim())
            stats["forks"] += 1
            stats["buffers"] = marked
            stats["bytes"] = sum(length for _, length in ranges)
            _log.info("zeroshim[%s]: starting DataLoader workers without %d offloaded buffer(s) (%.0f MiB of "
                      "optimizer state and parameter partitions): forked workers would otherwise keep a copy of "
                      "every page the optimizer rewrites", NAME, marked, stats["bytes"] / 2**20, once=(NAME, "info"))
    try:
        return wrapped(*args, **kwargs)
    finally:
        if ranges:
            with guard(NAME):
                _madvise(ranges, MADV_DOFORK)


# -- applying ---------------------------------------------------------------------------
def patch_dataloader(module, patcher: Patcher) -> None:
    import ctypes

    require(sys.platform.startswith("linux"), "MADV_DONTFORK is Linux-only")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        require(False, "the C library has no madvise")
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    _libc["libc"] = libc
    cls = require_attr(module, "_MultiProcessingDataLoaderIter")
    require_attr(cls, "__init__")
    patcher.wrap(cls, "__init__", _iterator_init)


def patch_deepspeed_engine(module, patcher: Patcher) -> None:
    _engines.use(NAME, module, patcher)


def _forget() -> None:
    _log.forget((NAME, "info"))


PATCH = Patch(
    name=NAME,
    summary="ZeRO offload + DataLoader workers: host memory grows each epoch, OOM early in epoch 2 (forked "
            "workers copy the offloaded optimizer state)",
    signatures=(),
    versions="every DeepSpeed release (acts while a ZeRO engine with CPU-resident state is alive and workers are forked)",
    affects={"deepspeed": ""},
    targets={
        "torch.utils.data.dataloader": patch_dataloader,
        "deepspeed.runtime.engine": patch_deepspeed_engine,
    },
    on_undo=_forget,
)
