"""Live DeepSpeed ZeRO engines, for patches that act on "the engine in use".

Several patches need to know which DeepSpeed engines with ZeRO are alive.
Rather than each wrapping ``DeepSpeedEngine.__init__`` (stacked wrappers of
two patches on one attribute cannot be undone independently and exactly),
they share one wrapper, installed when the first of them is applied and
removed when the last of them is undone: a patch calls :func:`use` from its
apply function for ``deepspeed.runtime.engine``, and its own patcher releases
the use on undo.  Engines are held by weak reference: a tracked engine never
outlives the user's last reference to it.
"""

from __future__ import annotations

import threading
import weakref

from ._patcher import Patcher, guard, require, require_attr

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Set

PATCH_NAME = "engine_tracking"  # the tag on the shared wrapper (never a user-facing patch)

# engine -> its ZeRO stage (engines with stage >= 1 only)
engines: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_users: "Set[str]" = set()
_patcher = Patcher(PATCH_NAME)
_lock = threading.RLock()


def _track(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    with guard(PATCH_NAME):
        stage = int(instance.zero_optimization_stage() or 0)
        if stage >= 1:
            engines[instance] = stage
    return result


def use(patch_name: str, module, patcher: Patcher) -> None:
    """Apply-function helper for the target ``deepspeed.runtime.engine``: make
    sure engines are tracked while ``patch_name`` is applied."""
    engine_cls = require_attr(module, "DeepSpeedEngine")
    require(callable(getattr(engine_cls, "zero_optimization_stage", None)),
            "DeepSpeedEngine.zero_optimization_stage does not exist")
    with _lock:
        if not _users:
            _patcher.wrap(engine_cls, "__init__", _track)
        _users.add(patch_name)
    patcher.on_undo(lambda: _release(patch_name))


def _release(patch_name: str) -> None:
    with _lock:
        _users.discard(patch_name)
        if not _users:
            _patcher.undo()
            engines.clear()


def users() -> "Set[str]":
    """The patches holding the tracker now."""
    with _lock:
        return set(_users)


def live(stage: int = 1) -> "List[object]":
    """The live engines with ZeRO stage >= ``stage``."""
    return [engine for engine, s in list(engines.items()) if s >= stage]


def max_stage() -> int:
    """The highest ZeRO stage of a live engine, 0 if there is none."""
    return max(engines.values(), default=0)
