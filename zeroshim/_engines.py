"""Live DeepSpeed ZeRO engines, for patches that act on "the engine in use".

Several patches need to know which DeepSpeed engines with ZeRO are alive.
Rather than each wrapping ``DeepSpeedEngine.__init__`` (stacked wrappers of
two patches on one attribute cannot be undone independently and exactly),
they share one tracker, installed when the first of them is applied and
removed when the last of them is undone: a patch calls :func:`use` from its
apply function for ``deepspeed.runtime.engine``, and its own patcher releases
the use on undo.  Engines are held by weak reference: a tracked engine never
outlives the user's last reference to it.

Engines built before the tracker was installed (``import zeroshim`` after
``deepspeed.initialize``, or ``zeroshim.apply()`` after an ``unpatch()``) are
found once, when it is installed, by a scan of the objects the garbage
collector tracks, after a collection so that engines the program already
dropped do not count (only when ``deepspeed.runtime.engine`` was imported
before; the cost of one ``gc.collect()`` and one pass over the objects).

The tracker also wraps ``DeepSpeedEngine.forward``: it keeps, per thread, the
engines whose forward is running (:func:`current`: the engine in use, which a
patch should prefer to "any live engine": an engine that has run keeps itself
alive through the hooks it registered on its own parameters, which the
garbage collector cannot see, so live is not the same as in use), and it runs
every applied patch's bypass probe (``Patch.bypass``: has another library
replaced what the patch wraps?) once per engine, at its first forward; the
probes also run when an engine is created.
"""

from __future__ import annotations

import threading
import weakref

from ._patcher import SHARED, Patcher, guard, require, require_attr

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Set

PATCH_NAME = "engine_tracking"  # the tag on the shared wrappers (never a user-facing patch)

# engine -> its ZeRO stage (engines with stage >= 1 only)
engines: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
# engines whose first forward has run the bypass probes
_probed: "weakref.WeakSet" = weakref.WeakSet()
_users: "Set[str]" = set()
_patcher = SHARED[PATCH_NAME] = Patcher(PATCH_NAME)
_lock = threading.RLock()
_local = threading.local()
#: engines found by the scan at install time, since import (introspection and tests)
stats = {"found_existing": 0}


def _register(engine) -> None:
    stage = int(engine.zero_optimization_stage() or 0)
    if stage >= 1:
        engines[engine] = stage


def _check_bypasses() -> None:
    from . import _core

    _core.check_bypasses()


def _track(wrapped, instance, args, kwargs):
    from . import _agree

    with guard(PATCH_NAME):  # the ranks agree about the patches that change collectives (RanksDisagree passes)
        _agree.check("DeepSpeedEngine.__init__")
    result = wrapped(*args, **kwargs)
    with guard(PATCH_NAME):
        _register(instance)
        _check_bypasses()
    return result


def _forward(wrapped, instance, args, kwargs):
    with guard(PATCH_NAME):
        if instance in engines and instance not in _probed:
            _probed.add(instance)
            _check_bypasses()
    stack = _in_forward()
    stack.append(instance)
    try:
        return wrapped(*args, **kwargs)
    finally:
        stack.pop()


def _in_forward() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current():
    """The innermost DeepSpeed engine whose forward is running on this thread, or None."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def stage_in_use() -> int:
    """The ZeRO stage of the engine whose forward is running on this thread (0 for
    a ZeRO-0 engine); outside any engine's forward, the highest stage of a live
    engine (a model called directly, ``engine.module(...)``)."""
    engine = current()
    if engine is not None:
        return engines.get(engine, 0)
    return max_stage()


def _existing(engine_cls) -> "List[object]":
    """Engines that already exist (built before the tracker was installed).
    Compared by ``type()``: ``isinstance`` reads ``__class__``, which some
    objects compute (torch's deprecated ``reduce_op`` warns when touched)."""
    import gc

    gc.collect()  # engines already dropped but still in reference cycles are not "live"
    classes, todo = set(), [engine_cls]
    while todo:  # DeepSpeedEngine and its subclasses (pipeline, hybrid engines)
        cls = todo.pop()
        if cls not in classes:
            classes.add(cls)
            todo.extend(cls.__subclasses__())
    return [obj for obj in gc.get_objects() if type(obj) in classes]


def use(patch_name: str, module, patcher: Patcher) -> None:
    """Apply-function helper for the target ``deepspeed.runtime.engine``: make
    sure engines are tracked while ``patch_name`` is applied."""
    engine_cls = require_attr(module, "DeepSpeedEngine")
    require(callable(getattr(engine_cls, "zero_optimization_stage", None)),
            "DeepSpeedEngine.zero_optimization_stage does not exist")
    require_attr(engine_cls, "forward")
    with _lock:
        if not _users:
            _patcher.wrap(engine_cls, "__init__", _track)
            _patcher.wrap(engine_cls, "forward", _forward)
            # Right after the module's own import no engine can exist yet; the
            # import machinery still marks the module as initialising then.
            if not getattr(getattr(module, "__spec__", None), "_initializing", False):
                with guard(PATCH_NAME):
                    found = _existing(engine_cls)
                    for engine in found:
                        _register(engine)
                    stats["found_existing"] += len(found)
        _users.add(patch_name)
    patcher.on_undo(lambda: _release(patch_name))


def _release(patch_name: str) -> None:
    with _lock:
        _users.discard(patch_name)
        if not _users:
            _patcher.undo()
            engines.clear()
            _probed.clear()


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
