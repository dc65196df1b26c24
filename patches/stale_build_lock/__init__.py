"""Stop waiting for good on a build lock that no process holds (DeepSpeed's JIT-built ops).

Symptom
    A DeepSpeed run hangs before training, printing nothing more and using
    no CPU: in ``deepspeed.init_distributed`` (the CPU comm op),
    ``deepspeed.initialize`` (``cpu_adam``, ``fused_adam``, ``utils``...) or
    wherever DeepSpeed first JIT-builds an op.  A stack dump (``py-spy
    dump``) shows ``FileBaton.wait`` (``torch/utils/file_baton.py``) under
    ``_jit_compile`` (``torch/utils/cpp_extension.py``) under DeepSpeed's
    ``OpBuilder.jit_load``.  It hangs again on every restart, on every rank.
    Reports: DeepSpeedExamples #302 (that stack, ``engine.py`` ``__init__``),
    transformers #26015 ("DeepSpeed stuck when training"; the maintainer's
    answer: ``rm -rf ~/.cache/torch_extensions/...``), transformers
    #12715/#12723 (a hanging nvme-offload test, fixed by clearing the
    extensions folder), lucidrains/DALLE-pytorch #172; seen here too: a
    launch killed at its timeout in the middle of the CPU comm op's build
    left every later launch waiting.

Cause
    torch's JIT build (``torch.utils.cpp_extension.load``, which DeepSpeed's
    op builders call) serialises processes with a file, ``<build
    dir>/lock``, created with ``O_CREAT | O_EXCL`` by the process that builds
    and removed when it is done.  The others wait in ``FileBaton.wait``,
    which polls for the file to go away, with no time limit and no message
    (its ``warn_after_seconds`` is never passed).  A builder killed before it
    removes the file (a ``kill -9``, a launcher's timeout, an out-of-memory
    kill, a node preempted) leaves the lock behind, and every later waiter
    polls for good.

Affected versions
    torch < 2.14, with every DeepSpeed release that JIT-builds ops
    (``DS_BUILD_OPS=0``, the default of ``pip install deepspeed``):
    ``torch.utils.file_baton`` has no notion of a dead holder, and
    ``_jit_compile`` creates ``FileBaton(os.path.join(build_directory,
    'lock'))`` without a time limit (read in the torch 2.13.0 wheel).  torch
    2.14.0 fixed it (pytorch #189245): ``_jit_compile`` holds an OS-level
    advisory lock (``FileLock``, ``flock``), which the kernel releases when
    its holder dies, so a killed build leaves nothing to wait on (read in the
    2.14.0, 2.14.1 and 2.15.0 wheels; shown in ``tests/test_stale_build_lock.py``:
    the stale lock of the reproduction is taken at once there without
    zeroshim).  The gate is the source: the patch acts where ``_jit_compile``
    still uses ``FileBaton`` (a fingerprint of ``torch.utils.cpp_extension``),
    whatever the version number says.

Flag
    ``ZEROSHIM_STALE_BUILD_LOCK=auto|on|off`` (default ``auto``).

Fix
    ``FileBaton.wait`` is wrapped, and ``torch.utils.cpp_extension._jit_compile``
    (to build again).  Only a wait inside ``_jit_compile`` is looked at.
    While the lock exists the wrapper polls as torch does and looks at the
    lock once a second, from the start.  A lock younger than ``MIN_AGE_S``
    (120 s, from its modification time) is left alone.  An older one is
    *stale* only where both of these hold at two looks a second apart: no
    process of this host has it open (the builder keeps the file open from
    its creation until just before it removes it; every ``/proc/<pid>/fd``
    is read, and one that cannot be read makes the verdict "cannot tell"),
    and it lies on a local filesystem (``/proc/mounts``: ext2/3/4, xfs,
    btrfs, tmpfs, overlay, zfs, f2fs, ramfs; on NFS, Lustre, GPFS, CIFS,
    CephFS, a FUSE mount... a builder on another node is invisible).  Then
    the waiter takes an advisory ``flock`` of ``lock.zeroshim`` next to it,
    judges the same file again there and removes it, so of several waiters
    exactly one removes it and none removes a newer lock; that process logs
    a WARNING (the path, its age, why, the flag).  ``_jit_compile`` then
    runs again, with torch's record of the extension's version as before
    the call (else it would load the build the killed builder never
    finished): one waiter takes the new lock and builds, the others wait
    for it.  A waiter that saw the lock stale and then gone runs
    ``_jit_compile`` again too (where the op is built, that only loads it).
    A "held" lock is waited on, however old (a build may take minutes).  A
    "cannot tell" lock is waited on after a WARNING naming it, its age and
    the remedy (delete it if no process on any node is building).  A wait
    outside ``_jit_compile`` is torch's own.

    Not caught: a builder in another PID namespace (another container)
    building into the same local folder for longer than ``MIN_AGE_S``; its
    lock would be taken for stale.

Undo
    ``zeroshim.unpatch("stale_build_lock")`` restores ``FileBaton.wait`` and
    ``_jit_compile``.
"""

from __future__ import annotations

import os
import threading
import time

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr
from zeroshim._source import Fingerprint

NAME = "stale_build_lock"
#: a lock younger than this (seconds since it was created) is never taken for stale
MIN_AGE_S = 120.0
#: filesystems on which every process that could hold a lock is on this host
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "ramfs"})
#: removed: stale locks this process removed; rebuilt: _jit_compile calls run again after one was removed;
#: unsure: waits on a lock zeroshim could not judge (warned)
stats = {"removed": 0, "rebuilt": 0, "unsure": 0}
_inside = threading.local()
#: torch's record of JIT-built extension versions (captured at apply time)
_torch: dict = {}
_MISSING = object()


class _Rebuild(Exception):
    """Raised by the wait wrapper after a stale lock was removed (here or by another waiter): ``_jit_compile``
    runs again."""


def holders(path: str) -> "tuple":
    """``(pids, unreadable)``: the processes of this host with ``path`` open, and how many
    processes' descriptor tables could not be read (other users' processes without privileges)."""
    target = os.path.realpath(path)
    pids, unreadable = [], 0
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return [], 1
    for entry in entries:
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:  # exited meanwhile
            continue
        except OSError:
            unreadable += 1
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") == target:
                    pids.append(int(entry))
                    break
            except OSError:
                continue
    return pids, unreadable


def filesystem(path: str) -> "str | None":
    """The filesystem type of the mount that holds ``path`` (None where /proc/mounts cannot be read)."""
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return None
    return kind


def judge(path: str) -> "tuple":
    """``(verdict, detail)`` for the lock at ``path``: "held" (a process here has it open),
    "stale" (none has it open, every process could be read, a local filesystem) or "unsure"."""
    pids, unreadable = holders(path)
    if pids:
        return "held", f"held by process {', '.join(map(str, pids))}"
    kind = filesystem(path)
    if kind not in LOCAL_FILESYSTEMS:
        return "unsure", (f"on a {kind or 'unknown'} filesystem, where the process that created it may run on "
                          "another node")
    if unreadable:
        return "unsure", f"{unreadable} process(es) of this host could not be read"
    return "stale", f"no process of this host has it open (a {kind} filesystem)"


def _identity(st: os.stat_result) -> tuple:
    """Which file a lock is (a new lock at the same path is another inode or change time)."""
    return st.st_ino, st.st_dev, st.st_ctime_ns


def _remove_if_stale(path: str, seen) -> str:
    """Remove the lock at ``path`` if it is still the file judged stale (same inode and change time) and
    still judged stale, under an advisory ``flock`` on ``<path>.zeroshim`` (released by the kernel if this
    process dies) so that of several waiters exactly one removes it and none removes a lock created after:
    "took", "gone" (another waiter removed it) or "changed"."""
    import fcntl

    with open(path + ".zeroshim", "a") as side:
        fcntl.flock(side, fcntl.LOCK_EX)
        try:
            try:
                if _identity(os.stat(path)) != seen:
                    return "changed"
            except FileNotFoundError:
                return "gone"
            if judge(path)[0] != "stale":
                return "changed"
            os.remove(path)
            return "took"
        finally:
            fcntl.flock(side, fcntl.LOCK_UN)


def _wait(wrapped, instance, args, kwargs):
    """Wraps ``FileBaton.wait()``."""
    path = None
    with guard(NAME):
        if is_active(NAME) and getattr(_inside, "depth", 0) > 0:
            path = instance.lock_file_path
    if path is None:
        return wrapped(*args, **kwargs)
    poll = getattr(instance, "wait_seconds", 0.1) or 0.1
    next_look, first_stale, warned, rebuild = time.monotonic(), None, False, False
    while os.path.exists(path) and not rebuild:
        now = time.monotonic()
        if now < next_look:
            time.sleep(poll)
            continue
        next_look = now + 1.0
        with guard(NAME):
            try:
                st = os.stat(path)
                seen, age = _identity(st), time.time() - st.st_mtime
            except FileNotFoundError:
                # gone; if it was judged stale, another waiter removed it and may not have taken the baton
                # yet: run _jit_compile again (harmless where the op is built: it only loads it then)
                rebuild = first_stale is not None
                continue
            if age < MIN_AGE_S:
                continue
            verdict, detail = judge(path)
            if verdict != "stale":
                first_stale = None
                if verdict == "unsure" and not warned:
                    warned = True
                    stats["unsure"] += 1
                    _log.warning("zeroshim[%s]: waiting on torch's build lock %s, created %.0f s ago and %s, so "
                                 "zeroshim cannot tell whether a build is still running.  torch waits on it with no "
                                 "time limit: if no process on any node is building this op, delete that file "
                                 "(or the folder %s) and the run goes on.", NAME, path, age, detail,
                                 os.path.dirname(path), scope=_log.EVERY, once=(NAME, "unsure", path))
                continue
            if first_stale != seen:
                first_stale = seen  # judge again a second later before acting (and rebuild if it goes away)
                continue
            taken = _remove_if_stale(path, seen)
            if taken == "changed":
                first_stale = None
                continue
            rebuild = True  # removed here, or by another waiter: take the baton or wait for the new builder
            if taken == "took":
                stats["removed"] += 1
                _log.warning("zeroshim[%s]: removed torch's build lock %s, created %.0f s ago: %s, so the build "
                             "that created it was killed before it finished, and torch would wait on it for good; "
                             "building the op again.  ZEROSHIM_%s=off turns this off.", NAME, path, age, detail,
                             NAME.upper(), scope=_log.EVERY, once=(NAME, "removed", path))
    if rebuild or (first_stale is not None and not os.path.exists(path)):
        raise _Rebuild(path)


def _jit_compile(wrapped, instance, args, kwargs):
    """Wraps ``torch.utils.cpp_extension._jit_compile(name, ...)``: runs it again after a stale lock was
    removed, with torch's record of the extension's version as it was before the call (the first
    call recorded the version it waited for; left so, the second would load that build, which the
    killed builder never finished, instead of building it)."""
    name = args[0] if args else kwargs.get("name")
    entries = getattr(_torch.get("versioner"), "entries", None)
    for attempt in range(3):
        prior = entries.get(name, _MISSING) if isinstance(entries, dict) else _MISSING
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return wrapped(*args, **kwargs)
        except _Rebuild:
            if attempt == 2:
                raise RuntimeError(f"zeroshim[{NAME}]: torch's build lock of {name} was found stale three times; "
                                   "delete its build folder and run again") from None
            stats["rebuilt"] += 1
            if isinstance(entries, dict):
                if prior is _MISSING:
                    entries.pop(name, None)
                else:
                    entries[name] = prior
        finally:
            _inside.depth -= 1


def patch_baton(module, patcher: Patcher) -> None:
    cls = require_attr(module, "FileBaton")
    require_attr(cls, "wait")
    patcher.wrap(cls, "wait", _wait)


def patch_cpp_extension(module, patcher: Patcher) -> None:
    require_attr(module, "_jit_compile")
    versioner = require_attr(module, "JIT_EXTENSION_VERSIONER")
    require(isinstance(getattr(versioner, "entries", None), dict),
            "torch.utils.cpp_extension.JIT_EXTENSION_VERSIONER has no `entries` dict")
    _torch["versioner"] = versioner
    patcher.wrap(module, "_jit_compile", _jit_compile)


def _reset() -> None:
    _torch.clear()


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="a run hangs for good at DeepSpeed's first JIT-built op (init_distributed, initialize): torch's "
            "build lock was left by a build that was killed",
    signatures=(),  # a hang prints nothing
    versions_note="JIT-built DeepSpeed ops, DS_BUILD_OPS=0; 2.14.0 locks with flock",
    affects={"torch": "<2.14"},
    fingerprint=Fingerprint("torch.utils.cpp_extension", r"FileBaton\(os\.path\.join\(build_directory",
                            "_jit_compile's lock file that only its removal releases (FileBaton; torch 2.14 "
                            "holds a FileLock, pytorch #189245)"),
    targets={"torch.utils.file_baton": patch_baton, "torch.utils.cpp_extension": patch_cpp_extension},
    on_undo=_reset,
)
