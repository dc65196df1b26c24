"""Recorded, reversible changes to other libraries' objects.

Every change a patch makes goes through a :class:`Patcher`, which remembers
exactly what was there before (including "nothing": an attribute that was only
inherited), so that :meth:`Patcher.undo` restores the original objects by
identity.  Wrappers are :class:`wrapt.FunctionWrapper` objects, which keep the
wrapped function's name, signature, docstring and descriptor behaviour
(functions, methods, classmethods, staticmethods).
"""

from __future__ import annotations

import logging
import sys

from . import _log

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing

if TYPE_CHECKING:  # typing costs import time; annotations are strings anyway
    from typing import Any, Callable, List, Optional, Tuple

log = logging.getLogger("zeroshim")

_MISSING = object()


class TargetChanged(Exception):
    """Raised by a patch's apply function when the code it patches is missing
    or not what the patch was written for.  The patch is then *skipped* (never
    half-applied) and the message is recorded as the reason."""


class NotAffected(TargetChanged):
    """Raised by an apply function that finds the bug absent in the code it
    inspects (e.g. the missing name exists after all): the patch is *skipped*
    as "not affected", quietly, like a version gate says no."""


def require(condition: Any, reason: str) -> None:
    """``TargetChanged(reason)`` unless ``condition`` holds."""
    if not condition:
        raise TargetChanged(reason)


def require_attr(owner: Any, attr: str) -> Any:
    """The raw attribute ``owner.attr`` (descriptor as stored, looked up along
    the MRO for classes), or ``TargetChanged`` if it does not exist."""
    import inspect

    try:
        return inspect.getattr_static(owner, attr)
    except AttributeError:
        name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
        raise TargetChanged(f"{name}.{attr} does not exist") from None


def require_params(func: "Callable", *names: str) -> None:
    """``TargetChanged`` unless ``func`` accepts every parameter in ``names``.

    Looks through decorators: ``__wrapped__`` chains, and for a bare
    ``(*args, **kwargs)`` wrapper (DeepSpeed's ``instrument_w_nvtx`` does not use
    functools.wraps) the functions held in its closure."""
    import inspect

    def accepts(candidate) -> bool:
        try:
            params = inspect.signature(candidate, follow_wrapped=True).parameters
        except (TypeError, ValueError):
            return False
        return all(n in params for n in names)

    seen, todo = set(), [func]
    while todo:
        candidate = todo.pop()
        if id(candidate) in seen or not callable(candidate):
            continue
        seen.add(id(candidate))
        if accepts(candidate):
            return
        todo.extend(cell.cell_contents for cell in (getattr(candidate, "__closure__", None) or ())
                    if inspect.isfunction(_cell(cell)))
    raise TargetChanged(f"{getattr(func, '__qualname__', func)} has no parameter(s) {', '.join(names)}")


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


#: zeroshim's own shared wrappers (not patches), by tag -> their Patcher: a module that installs such wrappers
#: announces itself here (``_engines``: "engine_tracking"), so that introspection (:func:`zeroshim.changes`,
#: :func:`zeroshim.get_original`) sees them without knowing that module
SHARED: "dict" = {}


class Patcher:
    """Applies and records the changes of one patch."""

    def __init__(self, patch_name: str):
        self.patch_name = patch_name
        # (owner, attr, previous value in owner's own __dict__ or _MISSING, new value)
        self._changes: "List[Tuple[Any, str, Any, Any]]" = []
        # (namespace dict, key, original, replacement): aliases rebound elsewhere
        self._aliases: "List[Tuple[dict, str, Any, Any]]" = []

    # -- applying -----------------------------------------------------------------
    def wrap(self, owner: Any, attr: str, wrapper: Callable, *, rebind_aliases: bool = False) -> Any:
        """Replace ``owner.attr`` by a :class:`wrapt.FunctionWrapper` calling
        ``wrapper(wrapped, instance, args, kwargs)``.

        Idempotent: if ``owner.attr`` is already this patch's wrapper it is
        returned unchanged.  With ``rebind_aliases``, module globals anywhere in
        ``sys.modules`` that hold the original object (``from x import f``
        done before zeroshim ran) are pointed at the wrapper too.
        """
        import wrapt  # lazily: see _hooks.py

        current = require_attr(owner, attr)
        if is_patched_by(current, self.patch_name):
            return current
        from . import _timing

        if _timing.ENABLED:  # benchmark mode: zeroshim's own time per patch (zeroshim/_timing.py)
            wrapper = _timing.timed_wrapper(self.patch_name, wrapper)
        wrapped = wrapt.FunctionWrapper(current, wrapper)
        wrapped._self_zeroshim_patch = self.patch_name  # `_self_` attributes stay on the proxy
        self.set(owner, attr, wrapped)
        if rebind_aliases:
            self._rebind_aliases(current, wrapped)
            # names bound to the wrapper after this (``from x import f`` once zeroshim ran): put back at undo too
            self.on_undo(lambda: self._unbind_later_aliases(owner, current, wrapped))
        return wrapped

    def wrap_hot(self, owner: Any, attr: str, wrapper: Callable, replacement: "Callable[[Callable], Callable]") -> Any:
        """For a method called hundreds of times a step: where ``owner.attr`` is a plain function defined
        on ``owner`` itself, put ``replacement(that function)`` (a plain function calling it) in its place
        (:meth:`set`), which costs a third of a wrapt wrapper a call; else (inherited, or already wrapped,
        by zeroshim or anyone) :meth:`wrap` it with ``wrapper``.  Both must do the same."""
        current = vars(owner).get(attr) if hasattr(owner, "__dict__") else None
        if is_patched_by(current, self.patch_name):
            return current
        if type(current).__name__ != "function":
            return self.wrap(owner, attr, wrapper)
        import functools

        # its name, and what the function carries (__wrapped__ for get_original(); a decorator's marks, such as
        # torch.compiler.disable's, which DeepSpeed puts on some of these)
        value = functools.update_wrapper(replacement(current), current)
        value._zeroshim_patch = self.patch_name  # is_patched_by()
        self.set(owner, attr, value)
        return value

    def on_undo(self, callback: "Callable[[], None]") -> None:
        """Run ``callback()`` when this patcher is undone (in reverse order with
        the other changes), e.g. to release a resource shared between patches."""
        self._changes.append((None, "", callback, None))

    def set(self, owner: Any, attr: str, value: Any) -> None:
        """``setattr(owner, attr, value)``, recorded for undo."""
        previous = vars(owner).get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        from . import _timing

        # (not ``__del__``: it can run at interpreter shutdown, when the timer's globals may be gone)
        if _timing.ENABLED and type(value).__name__ == "function" and attr != "__del__":
            value = _timing.timed_function(self.patch_name, value)  # benchmark mode (zeroshim/_timing.py)
        setattr(owner, attr, value)
        self._changes.append((owner, attr, previous, value))

    def _rebind_aliases(self, original: Any, replacement: Any) -> None:
        # Only plain functions are worth looking for: descriptors stored on a
        # class are never imported by name into another module's namespace.
        if type(original).__name__ != "function":
            return
        for namespace, key in _globals_holding(original):
            namespace[key] = replacement
            self._aliases.append((namespace, key, original, replacement))
        if self._aliases:
            log.debug("zeroshim[%s]: rebound %d alias(es) of %s", self.patch_name,
                      len(self._aliases), getattr(original, "__qualname__", original))

    @staticmethod
    def _unbind_later_aliases(owner: Any, original: Any, replacement: Any) -> None:
        """Module globals other than ``owner``'s own that hold ``replacement`` get ``original`` back (the owner's
        attribute is undone as a recorded change)."""
        for namespace, key in _globals_holding(replacement, skip=getattr(owner, "__dict__", None)):
            namespace[key] = original

    # -- undoing ------------------------------------------------------------------
    def undo(self) -> None:
        """Restore every recorded change, newest first.  Each attribute is put
        back only if it still holds what this patcher put there; if somebody
        else replaced it meanwhile, theirs is left alone (and logged)."""
        for namespace, key, original, replacement in reversed(self._aliases):
            if namespace.get(key) is replacement:
                namespace[key] = original
        self._aliases.clear()
        for owner, attr, previous, value in reversed(self._changes):
            if owner is None:  # a callback registered with on_undo()
                previous()
                continue
            own = vars(owner).get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
            if own is not value:
                if is_patched_by(own):  # another zeroshim patch wrapped it after this one: this wrapper stays
                    _log.log.debug("zeroshim[%s]: %r.%s is wrapped again by zeroshim patch %s; this wrapper stays "
                                   "under it and passes calls through", self.patch_name, owner, attr,
                                   getattr(own, "_self_zeroshim_patch", "?"))
                    continue
                _log.warning("zeroshim[%s]: %r.%s was replaced by someone else after zeroshim patched it; "
                             "leaving it as it is", self.patch_name, owner, attr, scope=_log.EVERY)
                continue
            if previous is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, previous)
        self._changes.clear()


def _globals_holding(value: Any, skip: "Optional[dict]" = None) -> "List[Tuple[dict, str]]":
    """``(namespace, key)`` of every module global in ``sys.modules`` that is ``value`` (``skip``: a module's
    namespace left out)."""
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or namespace is skip:
            continue
        try:
            found += [(namespace, k) for k, v in namespace.items() if v is value]
        except RuntimeError:  # pragma: no cover - dict changed during a concurrent import
            continue
    return found


def is_patched_by(obj: Any, patch_name: Optional[str] = None) -> bool:
    """True if ``obj`` is a zeroshim wrapper, or a replacement put by :meth:`Patcher.wrap_hot` (of
    ``patch_name``, if given)."""
    if type(obj).__name__ == "function":
        tag = getattr(obj, "_zeroshim_patch", None)
        return tag is not None and (patch_name is None or tag == patch_name)
    if "wrapt" not in sys.modules:
        return False
    import wrapt

    # FunctionWrapper, not ObjectProxy: since wrapt 2, ``wrapt.ObjectProxy`` is a
    # Python subclass of the C proxy that FunctionWrapper derives from, so
    # isinstance(wrapper, wrapt.ObjectProxy) is False for every wrapper.
    tag = getattr(obj, "_self_zeroshim_patch", None) if isinstance(obj, wrapt.FunctionWrapper) else None
    return tag is not None and (patch_name is None or tag == patch_name)


class CollectivePatchFailed(RuntimeError):
    """A patch that changes collectives failed inside its wrapper on this rank: it cannot fall back here
    alone (the other ranks would run other collectives), so the run stops (:class:`guard`)."""


def several_ranks() -> bool:
    """Whether this process is one of several ranks of an initialised process group (where a fallback on one
    rank alone could split them)."""
    from . import _dist

    return _dist.group() is not None


class guard:
    """``with guard(patch_name): ...`` around zeroshim's *own* logic inside a
    wrapper.  An exception there is logged (with traceback, once per patch) and
    swallowed, so the wrapper goes on to call the original function unchanged:
    a bug in zeroshim never hides, replaces or adds to the wrapped function's
    own errors.  Code that calls the wrapped function must stay outside.

    Except in a patch that changes collectives (``"collectives"`` in its
    ``changes``) in a process group of several ranks: falling back on one rank
    alone would leave the ranks running different collectives, a silent hang,
    so the error is logged on this rank and re-raised as
    :class:`CollectivePatchFailed`, naming the flag that turns the patch off."""

    def __init__(self, patch_name: str):
        self.patch_name = patch_name
        self.failed = False

    def __enter__(self) -> "guard":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        from . import _agree, _core

        if issubclass(exc_type, (_agree.RanksDisagree, CollectivePatchFailed)):  # stops the run: passes through
            return False
        self.failed = True
        patch = _core._patches.get(self.patch_name)
        if patch is not None and patch.collective and several_ranks():
            # falling back on this rank alone would leave the ranks running different collectives: a hang
            message = (f"zeroshim[{self.patch_name}]: internal error in a patch that changes which collectives "
                       "run; falling back on this rank alone would leave the ranks running different collectives "
                       f"(a hang), so the run stops here. {patch.flag}=off on every rank turns the patch off; "
                       "please report this")
            _log.emit(logging.ERROR, _log.EVERY, "%s", message, exc_info=(exc_type, exc, tb))
            raise CollectivePatchFailed(message) from exc
        _log.warning("zeroshim[%s]: internal error, falling back to the unpatched behaviour (please report this)",
                     self.patch_name, scope=_log.EVERY, once=("guard", self.patch_name), exc_info=(exc_type, exc, tb))
        return True
