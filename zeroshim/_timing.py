"""Benchmark mode: attribute zeroshim's own time (``ZEROSHIM_TIMING=1``, issue #28 item 3).

With the flag set when zeroshim is imported, every wrapper a patch installs
(:meth:`zeroshim._patcher.Patcher.wrap`) is timed, and the time spent inside
the function it wraps is subtracted: what remains is zeroshim's own time (its
checks, the dummy-loss graph walk, the bookkeeping), per patch.  A plain function
a patch puts in place of another (:meth:`~zeroshim._patcher.Patcher.set`, e.g.
``zero3_delegating_wrapper``'s ``hasattr``) is timed whole; the user's work that a
wrapper runs another way (``nonreentrant_checkpoint`` re-issuing a checkpoint call as
non-reentrant) is marked with :class:`original_work` and subtracted too.  Not covered: hooks a
patch registers on torch objects (``zero3_moe_leaf``'s forward pre-hook, the
dummy-loss walk's node pre-hooks, ``offload_worker_fork``'s at-fork hooks).

Off by default and meant for benchmarks (``benchmarks/attribution.py``): the
timers cost about a microsecond per wrapped call, counted as zeroshim's own time
(so the figure is an upper bound).  ``report()`` returns ``{patch: {"calls": n,
"seconds": s}}`` for this process; ``reset()`` empties it.  Values: ``1``/``0``
(``true``, ``on`` ...); a value that cannot be read leaves timing off, with a warning.
"""

from __future__ import annotations

import os
import threading
from time import perf_counter

VARIABLE = "ZEROSHIM_TIMING"

_totals: "dict" = {}
_local = threading.local()


def _read() -> bool:
    from . import _flags, _log

    value = os.environ.get(VARIABLE)
    if value is None:
        return False
    parsed = _flags.bool_or_none(value)
    if parsed is None:
        _log.warning("zeroshim: %s=%r cannot be read; timing stays off (valid: 1/0, true/false, on/off)",
                     VARIABLE, value)
        return False
    return parsed


ENABLED = _read()


def _add(name: str, seconds: float, function: int = 0) -> None:
    entry = _totals.get(name)
    if entry is None:
        entry = _totals[name] = [0, 0.0, 0]
    entry[0] += 1
    entry[1] += seconds
    entry[2] += function


def timed_wrapper(name: str, wrapper):
    """``wrapper(wrapped, instance, args, kwargs)`` whose own time, less the time in
    ``wrapped`` (and in any zeroshim wrapper nested inside it), is added to ``name``."""

    def timed(wrapped, instance, args, kwargs):
        return _own_time(name, 0, wrapper, _Original(wrapped), instance, args, kwargs)

    return timed


def _own_time(name: str, function: int, call, *args, **kwargs):
    """``call(*args, **kwargs)``, its time less its :class:`original_work` blocks added to ``name``
    (``function``: 1 for a replacement, 0 for a wrapper)."""
    inner = [0.0]  # time in the original and in original_work blocks (added by original_work)
    stack = _stack()
    stack.append(inner)
    start = perf_counter()
    try:
        return call(*args, **kwargs)
    finally:
        _add(name, perf_counter() - start - inner[0], function)
        stack.pop()


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class original_work:
    """``with original_work(): ...``: in benchmark mode the block's time is subtracted from the
    innermost timed wrapper's own time.  Every call of the wrapped function runs in one
    (:class:`_Original`); a wrapper that runs the user's work another way uses it too
    (``nonreentrant_checkpoint`` re-issuing a checkpoint call as non-reentrant)."""

    __slots__ = ("_start",)

    def __enter__(self):
        self._start = perf_counter() if ENABLED else None
        return self

    def __exit__(self, *exc):
        if self._start is not None:
            stack = _stack()
            if stack:
                stack[-1][0] += perf_counter() - self._start
        return False


class _Original:
    """Stands for the wrapped function inside a timed wrapper: a call runs as
    :class:`original_work` of that wrapper; attributes (``__name__``, ``__self__``, ...) and
    ``inspect.signature`` go to the function."""

    __slots__ = ("_f",)

    def __init__(self, f):
        self._f = f

    def __call__(self, *args, **kwargs):
        with original_work():
            return self._f(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._f, attr)

    @property
    def __wrapped__(self):
        return self._f

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(self._f)


def timed_function(name: str, function):
    """``function`` (a replacement set in place of another) timed under ``name``, whole but for the
    :class:`original_work` blocks it runs (``zero3_dummy_loss``'s multiplications call torch's own
    through :func:`original`)."""
    import functools

    @functools.wraps(function)
    def timed(*args, **kwargs):
        return _own_time(name, 1, function, *args, **kwargs)

    # what `function` replaced, not `function` (get_original() reads __wrapped__ of a replacement; wraps() has
    # copied the rest of its __dict__, zeroshim's tag included)
    timed.__wrapped__ = getattr(function, "__wrapped__", function)
    return timed


def original(function):
    """``function`` itself, or in benchmark mode a stand-in whose calls run as :class:`original_work`: for a
    replacement (:meth:`~zeroshim._patcher.Patcher.set`) that calls the function it replaces."""
    return _Original(function) if ENABLED else function


def report() -> dict:
    """``{patch: {"calls": n, "seconds": s, "function_calls": f}}``: zeroshim's own time in this process so far
    (``f`` of the ``n`` calls were of replacements, :func:`timed_function`; the others of wrappers)."""
    return {name: {"calls": calls, "seconds": seconds, "function_calls": function}
            for name, (calls, seconds, function) in sorted(_totals.items())}


def bias(calls: int = 20000) -> dict:
    """The timers' own time per call that :func:`report` counts as zeroshim's: ``{"wrapper": s, "function":
    s}``, measured on a wrapper and on a replacement that do nothing but call what they wrap (their own
    untimed cost, a Python call, is left in).  What it leaves out: a wrapt wrapper's dispatch, which runs
    outside its timer and is counted nowhere."""
    import wrapt

    def nothing():
        return None

    def wrapper(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    call = original(nothing)

    def replacement():
        return call()

    timed = {"wrapper": wrapt.FunctionWrapper(nothing, timed_wrapper("\0bias-wrapper", wrapper)),
             "function": timed_function("\0bias-function", replacement)}
    found = {}
    for kind, fn in timed.items():
        for _ in range(calls):
            fn()
        entry = _totals.pop("\0bias-" + kind)
        found[kind] = entry[1] / entry[0]
    return found


def reset() -> None:
    _totals.clear()
