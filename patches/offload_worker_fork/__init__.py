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

    Marks zeroshim did not set are left alone: before marking, one pass over
    ``/proc/self/smaps`` (the ``dc`` flag in ``VmFlags``, VM_DONTCOPY) finds
    the parts of those pages that already carry ``MADV_DONTFORK`` (an RDMA
    library's ``ibv_fork_init``, a driver, the program's own ``madvise``);
    zeroshim neither marks nor unmarks them, and afterwards unmarks exactly
    what it marked.  Where smaps cannot be read (or has no ``VmFlags``, Linux
    < 3.8) nothing is marked, and the reason is logged once at INFO.

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
    are removed right after the workers are started (also when starting them
    raises), so they never outlive it.  Nothing changes numerically (tested
    bit for bit).

    Other threads' forks: while the marks are set (the window), a fork from
    any other thread (``os.fork``, a ``multiprocessing`` fork ``Pool`` or
    ``Process``, an async checkpoint writer, a tokenizer pool) would give its
    child an address space without those pages, and the child would crash
    on reading them.  An ``os.register_at_fork`` hook (registered once;
    outside a window it only counts the forks in flight, after an undo it
    does nothing) removes zeroshim's marks before such a fork and sets them
    again after it (tested: the other thread's child reads the buffer and
    exits normally; without the hook it is killed by SIGSEGV).  Neither that
    thread nor the workers ever wait: blocking the other thread until the
    window closes deadlocks when it holds a lock that another at-fork hook
    registered after zeroshim's took before it (``concurrent.futures``'
    shutdown lock): the workers' own forks then wait for that lock
    (reproduced in a standalone script).  A worker forked while another
    thread's fork is in flight keeps the pages (memory, as without zeroshim,
    never a crash).  Two DataLoaders starting workers in two threads take
    turns.  ``subprocess`` without ``preexec_fn`` forks (or vforks) in C
    without running Python's at-fork hooks (checked) and executes a new
    program at once: its child never reads those pages and is not harmed;
    with ``preexec_fn`` the hooks run and its child has every page.  A fork made
    from C code that bypasses Python's hooks (a C library calling ``fork()``
    directly) during the window is not covered, nor is a mark another thread
    sets on the same pages during the window (zeroshim removes it with its
    own).

    ``pin_memory=True``: the DataLoader's option starts a pin-memory *thread*
    in the parent (torch's dataloader.py), nothing is forked for it, and
    without an accelerator torch ignores it with a warning (run here: no
    thread).  DeepSpeed's ``offload_optimizer.pin_memory`` /
    ``offload_param.pin_memory`` page-lock the offloaded buffers through the
    accelerator (``tensor.pin_memory()`` on CUDA; unchanged on the CPU
    accelerator): on CUDA such pages are marked and unmarked like any other;
    any ``MADV_DONTFORK`` a driver put on them is found in smaps and left as
    it is; a ``madvise`` the kernel refuses is counted (``madvise_errors``)
    and that range is then not unmarked.

    Not covered: ``persistent_workers=True`` loaders created before the engine
    (their workers already exist), and NVMe offload's swap buffers (small,
    pinned, rewritten from disk).

Undo
    ``zeroshim.unpatch("offload_worker_fork")`` restores
    ``_MultiProcessingDataLoaderIter.__init__`` (and releases engine tracking).

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``offload_worker_fork``.
"""

from __future__ import annotations

import bisect
import os
import re
import sys
import threading

from zeroshim import _engines, _log, _memory
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr

NAME = "offload_worker_fork"
MIN_BYTES = 1 << 20  # buffers smaller than this are not worth a madvise call
_EDGE = 64           # bytes kept forkable at each end of a buffer (allocator headers)
MADV_DOFORK, MADV_DONTFORK = 11, 10  # <asm-generic/mman-common.h>

#: counts since import (introspection and tests)
stats = {"forks": 0, "buffers": 0, "bytes": 0, "madvise_errors": 0, "trimmed": 0, "foreign_bytes": 0,
         "other_forks": 0, "skipped": 0}
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


def _madvise(ranges, advice: int) -> list:
    """``madvise(start, length, advice)`` for each ``(start, length)``; the ranges where it succeeded."""
    libc = _libc.get("libc")
    done = []
    for start, length in ranges:
        if libc.madvise(start, length, advice) == 0:
            done.append((start, length))
        else:
            stats["madvise_errors"] += 1
    return done


# -- marks that are not zeroshim's -------------------------------------------------------
# One smaps record per mapping: a header line "start-end perms offset dev inode [path]" (lower-case
# hex first), fields, and last "VmFlags: rd wr mr mw me dc ac sd" (Linux >= 3.8; ``dc``: VM_DONTCOPY).
_SMAPS_RECORD = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) |^VmFlags:([^\n]*)", re.M)


def _mappings(ranges):
    """The mappings that overlap ``ranges`` (sorted ``(start, length)``), as sorted ``(start, end,
    dontcopy)`` read from ``/proc/self/smaps`` in one pass; None (and why) if that cannot be read."""
    try:
        with open("/proc/self/smaps", "rb") as fh:
            data = fh.read()
    except OSError as exc:
        return None, f"/proc/self/smaps cannot be read ({exc})"
    low, high = ranges[0][0], max(start + length for start, length in ranges)
    starts = [start for start, _ in ranges]
    found, current, flags_seen = [], None, False
    for match in _SMAPS_RECORD.finditer(data):
        if match.group(1) is not None:
            start, end = int(match.group(1), 16), int(match.group(2), 16)
            current = (start, end) if start < high and end > low else None
            continue
        flags_seen = True
        if current is None:
            continue
        start, end = current
        i = bisect.bisect_right(starts, start) - 1  # the last range starting at or before this mapping
        if (i >= 0 and ranges[i][0] + ranges[i][1] > start) or (i + 1 < len(ranges) and ranges[i + 1][0] < end):
            found.append((start, end, b"dc" in match.group(3).split()))
        current = None
    if not flags_seen:
        return None, "/proc/self/smaps has no VmFlags lines (Linux < 3.8)"
    return found, ""


def _split(ranges, mappings):
    """``(to mark, already marked)``: the parts of ``ranges`` in mappings without VM_DONTCOPY (adjacent
    parts merged), and the parts already carrying it (someone else's mark: left as it is).  Parts in no
    mapping are in neither."""
    mark, kept = [], []
    starts = [start for start, _, _ in mappings]
    for start, length in ranges:
        end = start + length
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(mappings) and mappings[i][0] < end:
            lo, hi = max(start, mappings[i][0]), min(end, mappings[i][1])
            if hi > lo:
                into = kept if mappings[i][2] else mark
                if into and into[-1][0] + into[-1][1] == lo:
                    into[-1] = (into[-1][0], hi - into[-1][0])
                else:
                    into.append((lo, hi - lo))
            i += 1
    return mark, kept


# -- the window: from the marks to their removal ------------------------------------------
# Only one window at a time (a second DataLoader starting workers in another thread waits for it).
# A fork from any other thread while it is open lifts zeroshim's marks for that fork (at-fork hooks,
# below) and puts them back after it: that thread's child gets every page, the window's own forks (the
# workers) never wait.  ``_lock`` guards ``_window`` and is held only around madvise calls.
_window = {"owner": None, "ranges": [], "marked": False, "forking": 0}
_window_lock = threading.Lock()
_lock = threading.RLock()  # re-entrant: a signal handler or __del__ that forks on a thread holding it
_thread = threading.local()
_hooks = {"registered": False, "active": False}


def _before_fork() -> None:
    """``os.register_at_fork(before=...)``: runs in the forking thread before every ``os.fork()``."""
    if (not _hooks["active"] and _window["owner"] is None) or _window["owner"] == threading.get_ident():
        return  # no window (or unpatched), or the window's own fork (a worker): nothing to do
    with guard(NAME):
        with _lock:
            _window["forking"] += 1
            _thread.forking = True
            if _window["marked"]:
                _madvise(_window["ranges"], MADV_DOFORK)
                _window["marked"] = False
                stats["other_forks"] += 1


def _after_fork_in_parent() -> None:
    if not getattr(_thread, "forking", False):
        return
    with guard(NAME):
        with _lock:
            _thread.forking = False
            _window["forking"] -= 1
            if not _window["forking"] and _window["owner"] is not None and not _window["marked"]:
                _window["ranges"] = _madvise(_window["ranges"], MADV_DONTFORK)
                _window["marked"] = True


def _after_fork_in_child() -> None:
    global _lock, _window_lock
    _lock, _window_lock = threading.RLock(), threading.Lock()  # another thread may have held them at the fork
    _window.update(owner=None, ranges=[], marked=False, forking=0)
    _thread.forking = False


def _open(ranges) -> None:
    with _lock:
        _window.update(owner=threading.get_ident(), ranges=ranges, marked=False)
        if not _window["forking"]:  # else the last of those forks marks them (_after_fork_in_parent)
            _window["ranges"] = _madvise(ranges, MADV_DONTFORK)
            _window["marked"] = True


def _close(window_lock) -> None:
    """Unmark and close the window; ``window_lock`` is the lock object its opening acquired (in a child
    forked inside the window, the module's ``_window_lock`` is a new, unlocked one)."""
    try:
        with guard(NAME), _lock:
            try:
                if _window["marked"]:
                    _madvise(_window["ranges"], MADV_DOFORK)
            finally:
                _window.update(owner=None, ranges=[], marked=False)
    finally:
        window_lock.release()


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
    window = []  # [the window lock] once this call holds the window: it is closed whatever happens next
    try:
        with guard(NAME):
            _start(args[0] if args else kwargs.get("loader"), window)
        return wrapped(*args, **kwargs)
    finally:
        if window:
            _close(window[0])


def _start(loader, window: list) -> None:
    """Mark the offloaded buffers' pages before ``loader``'s workers are forked (opens the window)."""
    if not (is_active(NAME) and _engines.live(1) and loader is not None and _forks(loader)) \
            or _window["owner"] == threading.get_ident():
        return
    import mmap

    buffers = {}
    for engine in _engines.live(1):
        buffers.update(offloaded_buffers(engine))
    ranges = sorted(r for r in (_interior_pages(a, n, mmap.PAGESIZE) for a, n in buffers.items()) if r)
    kept = []
    if ranges:
        _window_lock.acquire()  # one window at a time
        window.append(_window_lock)
        mappings, why = _mappings(ranges)
        if mappings is None:
            window.pop().release()  # nothing marked: no window to hold while the workers start
            stats["skipped"] += 1
            _log.info("zeroshim[%s]: DataLoader workers start with the offloaded buffers: %s, so zeroshim cannot "
                      "tell which pages already carry MADV_DONTFORK (set by an RDMA library, a driver or the "
                      "program) and marks none rather than clear those", NAME, why, once=(NAME, "smaps"))
            return
        ranges, kept = _split(ranges, mappings)
        _open(ranges)
        ranges = _window["ranges"]
    # Freed heap the parent will reuse (gathered parameters, activations) would be shared too: returned
    # to the OS, those pages are in neither process until the parent writes them again.
    stats["trimmed"] += bool(_memory.malloc_trim())
    stats["forks"] += 1
    starts = [start for start, _ in ranges]
    stats["buffers"] = sum(1 for a, n in buffers.items() if _first_at_or_after(starts, a) < a + n)
    stats["bytes"] = sum(length for _, length in ranges)
    stats["foreign_bytes"] = sum(length for _, length in kept)
    _log.acted(NAME, "started DataLoader workers without %d offloaded buffer(s) (%.0f MiB of optimizer state and "
                     "parameter partitions)", "forked workers would otherwise keep a copy of every page the optimizer "
                     "rewrites", stats["buffers"], stats["bytes"] / 2**20)


def _first_at_or_after(starts, address: int) -> float:
    i = bisect.bisect_left(starts, address)
    return starts[i] if i < len(starts) else float("inf")


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
    if not _hooks["registered"]:  # once per process: at-fork hooks cannot be unregistered (inactive when undone)
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                            after_in_child=_after_fork_in_child)
        _hooks["registered"] = True
    _hooks["active"] = True
    patcher.wrap(cls, "__init__", _iterator_init)


def patch_deepspeed_engine(module, patcher: Patcher) -> None:
    _engines.use(NAME, module, patcher)


def _forget() -> None:
    _hooks["active"] = False


PATCH = Patch(
    changes=('memory',),
    name=NAME,
    summary="ZeRO offload + DataLoader workers: host memory grows each epoch, OOM early in epoch 2 (forked "
            "workers copy the offloaded optimizer state)",
    signatures=(),
    versions_note="acts while a ZeRO engine with CPU-resident state is alive and workers are forked",
    affects={"deepspeed": ""},
    targets={
        "torch.utils.data.dataloader": patch_dataloader,
        "deepspeed.runtime.engine": patch_deepspeed_engine,
    },
    on_undo=_forget,
)
