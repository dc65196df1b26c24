"""Source fingerprints: where a bug lives in a specific line of code, a patch
may say what must be in (or missing from) its target's source for the bug to
exist, so that vendor builds and forks with other version numbers get the
right verdict (a backported fix, a bug shipped under another number).

The source file is found the way ``import`` would find it (the first
``sys.path`` entry holding it) and read as text: nothing is imported, so
``zeroshim doctor`` gives the same verdict without importing DeepSpeed.  When
the file cannot be found (zip imports, frozen builds), the version gate alone
decides.
"""

from __future__ import annotations

import os
import re
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional, Tuple


class Fingerprint:
    """``pattern`` (a regex) in the source of ``module``: the bug exists where it
    is present (``bug_when="present"``, the buggy line) or where it is absent
    (``bug_when="absent"``, the fix's mark).  ``what`` names it for people."""

    __slots__ = ("module", "pattern", "what", "bug_when")

    def __init__(self, module: str, pattern: str, what: str, bug_when: str = "present"):
        if bug_when not in ("present", "absent"):
            raise ValueError("bug_when must be 'present' or 'absent'")
        self.module, self.pattern, self.what, self.bug_when = module, pattern, what, bug_when

    def __repr__(self) -> str:
        return f"Fingerprint({self.module!r}, {self.what!r}, bug when {self.bug_when})"


def module_file(name: str) -> "Optional[str]":
    """The ``.py`` file ``import name`` would load, found without importing."""
    parts = name.split(".")
    for entry in sys.path:
        base = os.path.join(entry or os.curdir, *parts)
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def check(fingerprint: Fingerprint) -> "Tuple[Optional[bool], str]":
    """``(bug exists?, what was seen)``; ``(None, why)`` if the source cannot be read."""
    path = module_file(fingerprint.module)
    if path is None:
        root = module_file(fingerprint.module.split(".")[0])
        if root is not None and os.path.basename(root) == "__init__.py" and fingerprint.bug_when == "present":
            # a package installed as source without that module: this release has no such code, so no such bug
            # (a package without sources, or a fix's mark that is absent, stays unread)
            return False, f"{fingerprint.module} does not exist in {os.path.dirname(root)}"
        return None, f"no source file found for {fingerprint.module}"
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as exc:
        return None, f"cannot read {path}: {exc}"
    found = re.search(fingerprint.pattern, text) is not None
    bug = found if fingerprint.bug_when == "present" else not found
    return bug, f"{fingerprint.what} is {'in' if found else 'not in'} {path}"


# -- the function that actually runs ------------------------------------------------------------
def _inner_functions(func) -> list:
    """What a decorator's wrapper runs: its ``__wrapped__`` chain (``functools.wraps``; torch's
    ``_disable_dynamo``), a ``functools.partial``'s function, a bound method's function, and the
    functions held in its closure (wrappers that do not use ``functools.wraps``)."""
    out = []
    for attr in ("__wrapped__", "__func__", "func"):
        value = getattr(func, attr, None)
        if callable(value):
            out.append(value)
    for cell in getattr(func, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if callable(value) and getattr(value, "__code__", None) is not None:
            out.append(value)
    return out


def _layers(func, limit: int = 20) -> list:
    """``func`` and every function its decorators' wrappers run, transitively (stacked decorators)."""
    out, seen, todo = [], set(), [func]
    while todo and len(out) < limit:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        out.append(current)
        todo.extend(_inner_functions(current))
    return out


def _source_of(func) -> "Optional[str]":
    """The source of the definition this function object was made from (its own code object: the
    definition that runs, never an ``@overload`` stub above it), or None.  Never raises."""
    import inspect

    code = getattr(func, "__code__", None)
    if code is None:
        return None
    try:
        return inspect.getsource(code)
    except Exception:  # noqa: BLE001 (OSError, TypeError, a file changed on disk: cannot tell)
        return None


def source_text(func) -> "Optional[str]":
    """The source of the function under ``func``'s ``functools.wraps`` decorators (``inspect.unwrap``), or
    None where it cannot be read (a build without ``.py`` files): never raises."""
    import inspect

    try:
        return _source_of(inspect.unwrap(func))
    except Exception:  # noqa: BLE001 (a __wrapped__ cycle: cannot tell)
        return None


def _name_of(func) -> str:
    code = func.__code__
    return f"{getattr(func, '__module__', None) or '?'}.{getattr(code, 'co_qualname', code.co_name)}"


def reaches(func, pattern: str, what: str = "", depth: int = 3) -> "Tuple[Optional[bool], str]":
    """Does calling ``func`` run code whose source matches ``pattern`` (a regex)?  ``(True, where)``
    when the pattern is in the source of the function that actually runs -- through decorators,
    stacked or not (``__wrapped__`` chains, closures) -- or of a function of the same module that it
    calls by name (``depth`` calls deep: a refactor that moves the body into a helper, such as torch
    2.14's ``checkpoint`` -> ``_checkpoint_impl``); ``(False, what was read)`` only when every
    function reached had source and none matched; ``(None, why)`` when some function reached had no
    readable source (a build without ``.py`` files): then the caller must not conclude that its
    target changed.  ``what`` names the pattern for people."""
    regex = re.compile(pattern)
    what = what or repr(pattern)
    seen: set = set()
    read: list = []
    unreadable: list = []
    frontier = [func]
    for _level in range(depth + 1):
        following = []
        for candidate in frontier:
            for current in _layers(candidate):
                code = getattr(current, "__code__", None)
                if code is None or id(code) in seen:
                    continue
                seen.add(id(code))
                name = _name_of(current)
                source = _source_of(current)
                if source is None:
                    unreadable.append(name)
                    continue
                if name not in read:
                    read.append(name)
                if regex.search(source):
                    return True, f"{what} is in {name}"
                namespace = getattr(current, "__globals__", None)
                if not isinstance(namespace, dict):
                    continue
                for called in code.co_names:  # functions of the same module it names (calls)
                    value = namespace.get(called)
                    value_code = getattr(value, "__code__", None)
                    if value_code is not None and value_code.co_filename == code.co_filename:
                        following.append(value)
                    elif value_code is None and callable(value) and _inner_functions(value):
                        following.append(value)  # a decorated helper of the same module
        frontier = following
        if not frontier:
            break
    if unreadable:
        return None, f"no source could be read for {', '.join(unreadable)}"
    if not read:
        return None, "no source could be read"
    return False, f"{what} is not in {', '.join(read)}"
