"""The default process group, as zeroshim's own checks need it: never imports torch (a process that has not
imported ``torch.distributed`` has no process group to ask)."""

from __future__ import annotations

import sys


def group() -> "tuple | None":
    """``(torch.distributed, world size, this rank)`` where this process is one of several ranks of an
    initialised default process group; None otherwise (also where asking raises)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        world = dist.get_world_size()
        return (dist, world, dist.get_rank()) if world > 1 else None
    except Exception:
        return None


def default_store(dist):
    """The default process group's c10d key-value store (torch's private accessor: raises where there is
    none, e.g. an MPI-only group)."""
    return dist.distributed_c10d._get_default_store()
