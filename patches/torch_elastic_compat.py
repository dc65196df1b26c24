"""Let old DeepSpeed import on current torch: restore two removed elastic-agent names.

Symptom
    ``import deepspeed`` fails before any training starts::

        ImportError: cannot import name '_get_socket_with_port' from
        'torch.distributed.elastic.agent.server.api'

    (DeepSpeed <= 0.14.0 also imports ``log`` from the same module and fails
    with ``cannot import name 'log'``.)

Cause
    ``deepspeed/elasticity/elastic_agent.py`` imported private helpers of
    torch's elastic agent.  torch renamed them: ``log`` became ``logger``
    (torch 2.3/2.4) and ``_get_socket_with_port`` moved to
    ``torch.distributed.elastic.utils.distributed.get_socket_with_port``
    (torch 2.4+).  DeepSpeed followed in #5346 (``log``, released in 0.14.1)
    and #5654 (``_get_socket_with_port``, released in 0.14.4; upstream issue
    #5603).

Affected versions
    DeepSpeed < 0.14.4 (checked in the tagged sources: v0.14.3 still imports
    ``_get_socket_with_port``, v0.14.4 does not; v0.14.0 and older import
    ``log`` as well) on a torch that no longer has the names.  Reproduced:
    DeepSpeed 0.14.1 on torch 2.13.0.  With a torch that still has both names,
    the patch reports itself skipped.

Flag
    ``ZEROSHIM_TORCH_ELASTIC_COMPAT=auto|on|off`` (default ``auto``).

Fix
    When ``torch.distributed.elastic.agent.server.api`` finishes importing
    (DeepSpeed's ``import`` of it triggers this), zeroshim adds the missing
    names: ``log`` as torch's own ``logger`` of that module, and
    ``_get_socket_with_port`` as torch's ``get_socket_with_port`` where it
    exists, else a small function that binds a listening socket to a free port
    on localhost (what DeepSpeed's elastic agent uses it for).  Nothing that
    exists is replaced.

Undo
    ``zeroshim.unpatch("torch_elastic_compat")`` deletes the added names.
"""

from __future__ import annotations

import socket

from zeroshim._core import Patch
from zeroshim._patcher import NotAffected, Patcher

NAME = "torch_elastic_compat"


def _socket_with_free_port() -> socket.socket:
    """A listening TCP socket on localhost bound to a port chosen by the OS."""
    last_error = None
    for family, kind, proto, _, _ in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(("localhost", 0))
            sock.listen(0)
            return sock
        except OSError as exc:
            last_error = exc
            sock.close()
    raise RuntimeError(f"could not bind a socket on localhost: {last_error}")


def patch_elastic_api(module, patcher: Patcher) -> None:
    added = []
    if not hasattr(module, "_get_socket_with_port"):
        try:
            from torch.distributed.elastic.utils.distributed import get_socket_with_port as replacement
        except ImportError:
            replacement = _socket_with_free_port
        patcher.set(module, "_get_socket_with_port", replacement)
        added.append("_get_socket_with_port")
    if not hasattr(module, "log") and hasattr(module, "logger"):
        patcher.set(module, "log", module.logger)
        added.append("log")
    if not added:
        raise NotAffected("torch still provides _get_socket_with_port and log")


PATCH = Patch(
    name=NAME,
    summary="old DeepSpeed fails to import: cannot import name '_get_socket_with_port' (or 'log')",
    signatures=(
        r"cannot import name '(_get_socket_with_port|log)' from 'torch\.distributed\.elastic\.agent\.server\.api'",
    ),
    affects={"deepspeed": "<0.14.4"},
    targets={"torch.distributed.elastic.agent.server.api": patch_elastic_api},
)
