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
    (torch 2.4+).

Affected versions
    Each name has its own range, read from ``elastic_agent.py`` (line 9) in
    the released sdists of 0.12.6 to 0.14.5:

    * ``log``: imported up to 0.14.0; #5346 (first released in 0.14.1)
      dropped the import and uses DeepSpeed's own logger, so only
      DeepSpeed < 0.14.1 needs it;
    * ``_get_socket_with_port``: imported up to 0.14.3; #5654 (first released
      in 0.14.4, upstream issue #5603) switched to torch's ``get_free_port``,
      so DeepSpeed < 0.14.4 needs it.

    The patch's gate is the union, ``<0.14.4``; within it each name is added
    only where the installed DeepSpeed imports it (``NAME_RANGES``) and torch
    lacks it.  Reproduced: DeepSpeed 0.14.1 on torch 2.13.0 (fails on
    ``_get_socket_with_port``).  With a torch that still has the names, the
    patch reports itself skipped.

Flag
    ``ZEROSHIM_TORCH_ELASTIC_COMPAT=auto|on|off`` (default ``auto``).

Fix
    When ``torch.distributed.elastic.agent.server.api`` finishes importing
    (DeepSpeed's ``import`` of it triggers this), zeroshim adds the names the
    installed DeepSpeed imports and torch lacks: ``log`` as torch's own
    ``logger`` of that module, and
    ``_get_socket_with_port`` as torch's ``get_socket_with_port`` where it
    exists, else a small function that binds a listening socket to a free port
    on localhost (what DeepSpeed's elastic agent uses it for).  Nothing that
    exists is replaced.

Undo
    ``zeroshim.unpatch("torch_elastic_compat")`` deletes the added names.
"""

from __future__ import annotations

from zeroshim import _versions
from zeroshim._core import Patch
from zeroshim._patcher import NotAffected, Patcher

NAME = "torch_elastic_compat"
#: name DeepSpeed imports from torch's elastic agent -> the DeepSpeed releases that import it
NAME_RANGES = {"log": "<0.14.1", "_get_socket_with_port": "<0.14.4"}


def _socket_with_free_port():
    """A listening TCP socket on localhost bound to a port chosen by the OS."""
    import socket

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


def needed_names() -> "list":
    """The names the installed DeepSpeed imports from torch's elastic agent
    (all of them where the version cannot be read or the patch is forced on)."""
    version = _versions.installed("deepspeed")
    if version is None:
        return list(NAME_RANGES)
    return [name for name, spec in NAME_RANGES.items() if _versions.in_range(version, spec) is not False]


def patch_elastic_api(module, patcher: Patcher) -> None:
    added = []
    needed = needed_names()
    if "_get_socket_with_port" in needed and not hasattr(module, "_get_socket_with_port"):
        try:
            from torch.distributed.elastic.utils.distributed import get_socket_with_port as replacement
        except ImportError:
            replacement = _socket_with_free_port
        patcher.set(module, "_get_socket_with_port", replacement)
        added.append("_get_socket_with_port")
    if "log" in needed and not hasattr(module, "log") and hasattr(module, "logger"):
        patcher.set(module, "log", module.logger)
        added.append("log")
    if not added:
        raise NotAffected(f"torch still provides what this DeepSpeed imports ({', '.join(needed) or 'nothing'})")


PATCH = Patch(
    changes=('import',),
    name=NAME,
    summary="old DeepSpeed fails to import: cannot import name '_get_socket_with_port' (or 'log')",
    signatures=(
        r"cannot import name '(_get_socket_with_port|log)' from 'torch\.distributed\.elastic\.agent\.server\.api'",
    ),
    versions_note="`log`: DeepSpeed < 0.14.1 only",
    affects={"deepspeed": "<0.14.4"},
    targets={"torch.distributed.elastic.agent.server.api": patch_elastic_api},
)
