"""Logging fit for 8 ranks x N nodes.

zeroshim logs through the standard ``logging.getLogger("zeroshim")`` and never
configures handlers itself (``ZEROSHIM_LOG_LEVEL`` adds one on request).  What
differs from a plain logger is *where* a message is worth showing.  Every
message has one of three scopes:

``RANK0``
    The same on every rank of a job (a patch applied, a conversion announced):
    logged at its level on global rank 0 only, at DEBUG elsewhere.
``NODE``
    Derived from this node's environment or installation (a bad flag, a target
    that changed, a patch that failed, another library that replaced a
    target): logged at its level on local rank 0 of each node, DEBUG on the
    other local ranks.  Launchers hand environments over per node, and nodes
    can differ there, so one line per node is what is worth reading.
``EVERY``
    About this process alone (an internal error, an epoch boundary that could
    not free memory): logged on every rank.

Ranks are read from the environment at the moment of logging (no torch
import): global rank from ``RANK`` (torchrun, deepspeed, accelerate), else
``OMPI_COMM_WORLD_RANK`` / ``PMI_RANK`` / ``SLURM_PROCID`` (mpirun, srun),
else ``LOCAL_RANK``; local rank from ``LOCAL_RANK``, else
``OMPI_COMM_WORLD_LOCAL_RANK`` / ``MPI_LOCALRANKID`` / ``SLURM_LOCALID``.  A
process with none of them is rank 0.  ``once=True`` logs a given message key
at most once per process.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("zeroshim")

RANK0 = "rank0"
NODE = "node"
EVERY = "every"

_GLOBAL_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "LOCAL_RANK")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")

_seen: set = set()
_seen_lock = threading.Lock()


def _first_int(names, environ=None) -> int:
    environ = os.environ if environ is None else environ
    for name in names:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def global_rank(environ=None) -> int:
    """This process's global rank as the launcher's environment says (0 if none does)."""
    return _first_int(_GLOBAL_RANK_VARS, environ)


def local_rank(environ=None) -> int:
    """This process's rank on its node as the launcher's environment says (0 if none does)."""
    return _first_int(_LOCAL_RANK_VARS, environ)


def level_for(level: int, scope: str) -> int:
    """``level`` where ``scope`` says this process should show it, else DEBUG."""
    if scope == RANK0 and global_rank() != 0:
        return logging.DEBUG
    if scope == NODE and local_rank() != 0:
        return logging.DEBUG
    return level


def emit(level: int, scope: str, msg: str, *args, once: "object" = None, exc_info=None) -> bool:
    """Log ``msg % args`` at ``level`` for ``scope``.  ``once``: a key; a
    message with a key already logged in this process is dropped.  Returns
    whether it was logged (not dropped as a repeat)."""
    if once is not None:
        with _seen_lock:
            if once in _seen:
                return False
            _seen.add(once)
    log.log(level_for(level, scope), msg, *args, exc_info=exc_info)
    return True


def info(msg: str, *args, scope: str = RANK0, once: "object" = None) -> bool:
    return emit(logging.INFO, scope, msg, *args, once=once)


def warning(msg: str, *args, scope: str = NODE, once: "object" = None, exc_info=None) -> bool:
    return emit(logging.WARNING, scope, msg, *args, once=once, exc_info=exc_info)


def acted(patch: str, what: str, why: str, *args) -> bool:
    """The one line a patch logs when it first changes what the user's code does
    (as transformers' ``warning_once`` when it overrides a setting): what it
    changed, why, what kind of change that is (its declared ``changes``), and the
    flag that turns it off.  ``what``/``why`` are %-format strings taking ``args``
    in order.

    Said once per job, by whichever rank acts first: the first acting rank of the
    job (counted in the process group's key-value store, no collective) logs it,
    naming itself where it is not rank 0; the others log it at DEBUG.  Where
    ``torch.distributed`` is not initialised, global rank 0 logs it.  Level: a
    patch that changes the numbers, memory, autograd or collectives of a run that
    would have trained (:attr:`Patch.visible`) says it at WARNING; one that acts
    only where the run would fail, or adds a missing name, at INFO.  Returns
    whether this process logged it at that level."""
    with _seen_lock:
        if (patch, "acted") in _seen:
            return False
        _seen.add((patch, "acted"))
    declaration = _declaration(patch)
    visible = declaration is None or declaration.visible
    level = logging.WARNING if visible else logging.INFO
    kinds = [k for k in getattr(declaration, "changes", ()) if k not in ("error", "import")]
    changes = f" This changes the run's {' and '.join(kinds)}." if visible and kinds else ""
    first = _first_in_job(patch)
    if first is None:
        first, where = global_rank() == 0, ""
    else:
        where = f" (rank {global_rank()} acted first)" if global_rank() != 0 else ""
    flag = "ZEROSHIM_" + patch.upper()
    log.log(level if first else logging.DEBUG, f"zeroshim[%s]: {what}, because {why}.{changes}{where} "
            "%s=off turns this off.", patch, *args, flag)
    return first


def _declaration(patch: str):
    from . import _core

    return _core._patches.get(patch)


def _first_in_job(patch: str) -> "bool | None":
    """Whether this process is the job's first to act for ``patch`` (None where no store can say)."""
    from . import _dist

    found = _dist.group()
    if found is None:
        return None
    try:
        store = _dist.default_store(found[0])
        # per round: after an undo the patch says so again when it acts again (every rank undoes alike)
        return store.add(f"zeroshim/acted/{patch}/{_rounds.get(patch, 0)}", 1) == 1
    except Exception:  # no store (an MPI-only group): rank 0 speaks
        return None


_rounds: dict = {}  # patch -> how many times its "acted" line was forgotten (the job-wide key's round)


def forget(key: object) -> None:
    """Let a ``once`` message with this key be logged again (after an undo)."""
    with _seen_lock:
        if key in _seen and isinstance(key, tuple) and len(key) == 2 and key[1] == "acted":
            _rounds[key[0]] = _rounds.get(key[0], 0) + 1
        _seen.discard(key)


def forget_patch(patch: str) -> None:
    """Let every ``once`` message of ``patch`` be logged again (its undo): the keys ``(patch, ...)``, and the
    core's own about it, ``("guard", patch)`` and ``("bypass", patch, ...)``."""
    with _seen_lock:
        keys = [key for key in _seen if isinstance(key, tuple) and key and
                (key[0] == patch or (key[0] in ("guard", "bypass") and key[1:2] == (patch,)))]
    for key in keys:
        forget(key)
