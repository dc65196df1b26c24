"""The patch lifecycle: the registry, version gates, flags, post-import hooks,
status, undo and public introspection.

A patch is declared once (``zeroshim/_declare.py``), as a :class:`Patch` named
``PATCH`` in its own folder ``patches/<name>/`` (``zeroshim.patches.<name>``).  Its ``targets`` map module names to functions that
patch that module once it is imported; :func:`sync` registers a wrapt
post-import hook per target, so a target imported later is patched the moment
its import finishes, and a target already imported is patched at once.
"""

from __future__ import annotations

import logging
import os as _os
import threading
TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing

from . import _agree, _flags, _hooks, _log, _versions
from ._patcher import NotAffected, Patcher, TargetChanged

if TYPE_CHECKING:  # typing costs import time; annotations are strings anyway
    from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

    ApplyFn = Callable[[object, Patcher], None]

from ._declare import (  # noqa: F401  (re-exported: the states and the declaration)
    APPLIED, BYPASSED, DISABLED, FAILED, PENDING, SKIPPED, Patch, PatchStatus,
)

log = logging.getLogger("zeroshim")


class _State:
    __slots__ = ("state", "reason", "mode", "why", "gate", "sticky", "patcher", "done", "busy", "queued",
                 "undo_after")

    def __init__(self) -> None:
        self.state = PENDING
        self.reason = ""
        self.mode = "auto"
        self.why = ""                     # which flag set the mode
        self.gate: "Optional[Tuple[bool, str]]" = None  # version gate, evaluated lazily
        self.sticky = False               # skipped/failed because of its target: not retried
        self.patcher: "Optional[Patcher]" = None
        self.done: "Set[str]" = set()
        # applying happens outside _lock (an apply function may import, and another thread's import may fire
        # a hook that needs _lock): the thread applying this patch now, the targets that arrived meanwhile,
        # and an undo asked for meanwhile (done by that thread when its apply returns)
        self.busy: "Optional[int]" = None
        self.queued: "List[Tuple[str, object]]" = []
        self.undo_after: "Optional[Tuple[str, str]]" = None


_lock = threading.RLock()
_patches: "Dict[str, Patch]" = {}
_states: "Dict[str, _State]" = {}
_waiting: "Set[Tuple[str, str]]" = set()
_env_settings: "Optional[_flags.Settings]" = None
_overrides: "Dict[str, object]" = {"enabled": None, "only": None, "modes": {}, "raw": {}}
_unpatched: "Set[str]" = set()
_agreed_off: "Dict[str, str]" = {}  # patch -> why every rank turned it off (``_agree``: the ranks disagreed)
_modules: "Dict[str, object]" = {}  # patch name -> its module (zeroshim.patches.<name>)
_initial_stats: "Dict[str, dict]" = {}  # patch name -> a copy of its counters as imported (_forget)
_order: "List[str]" = []  # every known patch, in the registry's order (the shipped ones, then registered ones)
#: a shipped patch not imported yet -> its targets and its optional ones, from the generated index
_declared: "Dict[str, Tuple[Tuple[str, ...], FrozenSet[str]]]" = {}
_stale: "Set[str]" = set()  # patches imported whose targets the index named otherwise
#: the generated index of the shipped patches' targets (written by ``python -m zeroshim._docs``)
INDEX = "zeroshim.patches._targets"


# -- registry -----------------------------------------------------------------------
def _known() -> "List[str]":
    """Every patch's name, in the registry's order.  A shipped patch's module is imported when one of its targets
    is, or when its declaration is asked for (:func:`get_patch`, :func:`load_patches`): ``import zeroshim``
    knows the names and targets from the index :data:`INDEX`, generated from the declarations, and imports no
    patch (issue #47 item 8: in every process ``zeroshim-run`` starts).  Without a usable index (absent, or
    naming other patches than the registry) every patch is imported here, as before."""
    if _order:
        return _order
    with _lock:
        if not _order:
            names = list(_patches_package().PATCH_MODULES)
            index = _read_index(names)
            for name in names:
                _states.setdefault(name, _State())
            if index is None:
                for name in names:
                    _load(name)
            else:
                _declared.update(index)
            _order.extend(names)
    return _order


def _read_index(names: "List[str]") -> "Optional[Dict[str, Tuple[Tuple[str, ...], FrozenSet[str]]]]":
    from importlib import import_module

    try:
        index = import_module(INDEX)
        targets, optional = dict(index.TARGETS), dict(index.OPTIONAL)
        if list(targets) != names:
            return None
        return {name: (tuple(targets[name]), frozenset(optional.get(name, ()))) for name in names}
    except Exception:  # an index that cannot be read: import the patches instead
        return None


def _load(name: str) -> Patch:
    """Import shipped patch ``name``'s module (once): its declaration."""
    patch = _patches.get(name)
    if patch is not None:
        return patch
    from importlib import import_module

    module = import_module(f"zeroshim.patches.{name}")
    with _lock:
        if name in _patches:
            return _patches[name]
        patch = module.PATCH
        if patch.name != name:  # pragma: no cover - a packaging mistake
            raise RuntimeError(f"zeroshim.patches.{name} declares a patch named {patch.name!r}")
        if not patch.doc:
            patch.doc = module.__doc__ or ""
        _modules[name] = module
        _patches[name] = patch
        if isinstance(getattr(module, "stats", None), dict):  # what its undo puts back (_undo)
            from copy import deepcopy

            _initial_stats[name] = deepcopy(module.stats)
        declared = _declared.pop(name, None)
        if declared is not None and (tuple(patch.targets), patch.optional) != declared:
            # a stale index (a source checkout edited without regenerating it): its targets are the ones it
            # declares; the next sync() watches those it did not know
            log.debug("zeroshim: the index of patch targets is stale for %s", name)
            _stale.add(name)
    return patch


def _targets(name: str) -> "Tuple[Tuple[str, ...], FrozenSet[str]]":
    """A known patch's targets and optional targets, without importing it."""
    patch = _patches.get(name)
    if patch is not None:
        return tuple(patch.targets), patch.optional
    return _declared[name]


def load_patches() -> Dict[str, Patch]:
    """Every patch's declaration, in the registry's order (imports the patch modules not imported yet; cheap:
    they import nothing heavy at module level)."""
    return {name: _load(name) for name in _known()}  # (a registered patch is in _patches: _load returns it)


def _patches_package():
    """``zeroshim.patches``: installed from the repository's top-level
    ``patches/`` by a package-dir mapping.  In a source checkout used without
    installing (``PYTHONPATH=.``) the mapping does not exist, so the same
    directory is loaded under that name."""
    import os
    import sys
    from importlib import import_module, util

    try:
        return import_module("zeroshim.patches")
    except ModuleNotFoundError as exc:
        source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patches")
        if exc.name != "zeroshim.patches" or not os.path.isfile(os.path.join(source, "__init__.py")):
            raise
    spec = util.spec_from_file_location("zeroshim.patches", os.path.join(source, "__init__.py"),
                                        submodule_search_locations=[source])
    module = util.module_from_spec(spec)
    sys.modules["zeroshim.patches"] = module
    spec.loader.exec_module(module)
    return module


def register(patch: Patch) -> None:
    """Add a patch that does not live in ``zeroshim.patches`` (tests, plugins)
    and sync it.  Registering the same name twice is an error."""
    with _lock:
        if patch.name in _known():
            raise ValueError(f"a zeroshim patch named {patch.name!r} is already registered")
        _patches[patch.name] = patch
        _states[patch.name] = _State()
        _order.append(patch.name)
        value = _os.environ.get(patch.flag)
        if _env_settings is not None and value is not None:  # its ZEROSHIM_<NAME>
            _env_settings.modes[patch.name] = _flags.parse_mode(value, patch.flag)
            _env_settings.mode_by[patch.name] = f"{patch.flag}={value}"
    sync()


def deregister(name: str) -> None:
    """Undo and forget a patch added by :func:`register`."""
    with _lock:
        state = _states[name]
        _undo(name, state, DISABLED, "deregistered")
        _patches.pop(name), _states.pop(name), _order.remove(name)
        _unpatched.discard(name)


def patch_names() -> Tuple[str, ...]:
    return tuple(_known())


def get_patch(name: str) -> Patch:
    """Patch ``name``'s declaration (``KeyError`` for a name no patch has)."""
    if name not in _known():
        raise KeyError(name)
    return _load(name)


# -- introspection (public: scenarios, tests and other libraries use these, never private state) --
class Change(tuple):
    """One attribute a patch replaced: ``(owner, attr, original, replacement)``;
    ``original`` is what ``owner.__dict__`` held at apply time (``None`` with
    ``missing=True`` where the attribute was inherited or absent)."""

    __slots__ = ()

    def __new__(cls, owner, attr, original, replacement):
        return tuple.__new__(cls, (owner, attr, original, replacement))

    owner = property(lambda self: self[0])
    attr = property(lambda self: self[1])
    original = property(lambda self: self[2])
    replacement = property(lambda self: self[3])


def stats(name: str) -> dict:
    """A copy of what patch ``name`` has done in this process (its own
    counters, e.g. ``{"gathered": 2}``); ``{}`` for a patch that keeps none."""
    _load(_check_names([name], "stats")[0])
    return dict(getattr(_modules.get(name), "stats", None) or {})


def changes(name: str) -> "List[Change]":
    """The attributes patch ``name`` has replaced and not undone, in the order
    it replaced them (or a tag of zeroshim's own shared wrappers, such as
    ``"engine_tracking"``: the engine tracker the ZeRO patches share).  Empty
    for a patch that is not applied."""
    from ._patcher import _MISSING, SHARED

    if name in SHARED:
        patcher = SHARED[name]
    else:
        _check_names([name], "changes")
        patcher = _states[name].patcher
    records = list(patcher._changes) if patcher is not None else []
    return [Change(owner, attr, None if previous is _MISSING else previous, value)
            for owner, attr, previous, value in records if owner is not None]


def _change_of(owner: object, attr: str) -> "Optional[Change]":
    from ._patcher import _MISSING, SHARED

    # the owner's own attribute, as the patcher set it: through the class, a wrapt wrapper of a method is bound
    # anew at each access (wrapt >= 2), so ``getattr`` never gives back the object zeroshim stored
    current = vars(owner).get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    if current is _MISSING:
        current = getattr(owner, attr, None)

    for name in tuple(SHARED) + patch_names():
        for change in changes(name):
            if change.owner is owner and change.attr == attr and change.replacement is current:
                return change
    return None


def is_object_patched(owner: object, attr: str) -> bool:
    """True if ``owner.attr`` is, right now, a replacement zeroshim made (as
    gevent.monkey's ``is_object_patched``)."""
    return _change_of(owner, attr) is not None


def get_original(owner: object, attr: str) -> object:
    """What ``owner.attr`` was before zeroshim replaced it (captured at apply
    time); ``owner.attr`` itself where zeroshim did not replace it.  Where the
    attribute was inherited, the inherited object."""
    change = _change_of(owner, attr)
    if change is None:
        return getattr(owner, attr)
    if change.original is not None:
        return change.original
    wrapped = getattr(change.replacement, "__wrapped__", None)
    return wrapped if wrapped is not None else change.replacement


# -- flags --------------------------------------------------------------------------
def _settings() -> _flags.Settings:
    global _env_settings
    names = patch_names()
    if _env_settings is None:
        _env_settings = _flags.from_environ(names)
    settings = _flags.apply_overrides(_env_settings.copy(), enabled=_overrides["enabled"],  # type: ignore[arg-type]
                                      only=_overrides["only"], modes=_overrides["modes"],  # type: ignore[arg-type]
                                      raw=_overrides["raw"])  # type: ignore[arg-type]
    for name in _unpatched:
        settings.modes[name] = "off"
        settings.mode_by[name] = "zeroshim.unpatch()"
    for name, why in _agreed_off.items():
        settings.modes[name] = "off"
        settings.mode_by[name] = why
    return settings


def reread_environment() -> None:
    """Read the patches' flags and ``ZEROSHIM_LOG_LEVEL`` from the environment again and bring every patch to what
    they now ask for.  For a process forked from one that imported zeroshim under another environment (the ranks
    of a pre-fork server, ``zeroshim/_prefork.py``): its flags were read there, once, at import.  What
    :func:`configure` set stays, as it does over the environment.  Not undone: what the first import did under
    the old flags (patches applied then undone, a gate found false for good, lines already logged), a log level
    the old environment set and the new one does not, and ``ZEROSHIM_TIMING`` (read at the first wrap)."""
    global _env_settings
    with _lock:
        _env_settings = None
    _flags.configure_logging()
    sync()


def agree_off(name: str, why: str) -> None:
    """Turn a patch off because the ranks disagreed about it (``_agree``), until :func:`reset_overrides`."""
    with _lock:
        _agreed_off[name] = why
    sync()


def configure(enabled: Optional[bool] = None, only: Optional[Iterable[str]] = None, **modes: object) -> None:
    """Set flags from Python (they win over the environment) and apply/undo
    accordingly.  ``ValueError`` (naming what is valid) for an unknown patch
    name or a value that cannot be read; nothing is changed then."""
    enabled, only_names, checked = _flags.validate_overrides(patch_names(), enabled=enabled, only=only, modes=modes)
    with _lock:
        if enabled is not None:
            _overrides["enabled"] = enabled
        if only_names is not None:
            _overrides["only"] = only_names
        _overrides["modes"].update(checked)  # type: ignore[union-attr]
        _overrides["raw"].update({k.lower(): v for k, v in modes.items()})  # type: ignore[union-attr]
    sync()


def reset_overrides() -> None:
    """Forget everything set through :func:`configure`, :func:`apply` and :func:`unpatch`."""
    with _lock:
        _overrides.update(enabled=None, only=None, modes={}, raw={})
        _unpatched.clear()
        _agreed_off.clear()
    sync()


def _check_names(names: Iterable[str], where: str) -> List[str]:
    """``names``, or ``ValueError`` naming the valid ones if one is unknown."""
    valid = patch_names()
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise ValueError(f"{where}: unknown patch name(s) {', '.join(map(repr, unknown))}; "
                         f"valid patch names: {', '.join(valid)}")
    return list(names)


def apply(*names: str) -> Dict[str, PatchStatus]:
    """Apply the named patches (default: all) as far as the flags allow; cancels
    an earlier :func:`unpatch`.  Idempotent."""
    with _lock:
        for name in _check_names(names, "zeroshim.apply()") if names else patch_names():
            _unpatched.discard(name)
    sync()
    return status()


def unpatch(*names: str) -> Dict[str, PatchStatus]:
    """Undo the named patches (default: all), restoring the original objects, and
    keep them off until :func:`apply`."""
    with _lock:
        _unpatched.update(_check_names(names, "zeroshim.unpatch()") if names else patch_names())
    sync()
    return status()


# -- applying -----------------------------------------------------------------------
def sync() -> None:
    """Bring every patch to the state its flags ask for.  Version gates are
    evaluated lazily: when a patch's first target module is imported (so that
    ``import zeroshim`` does not pay for ``packaging``), or by :func:`status`.
    Decided under the lock; the hooks are registered (and targets already
    imported are patched) after it is released (see :func:`_on_import`)."""
    watch: "List[Tuple[str, str]]" = []
    with _lock:
        settings = _settings()
        names = list(_known())
        decided = {name: settings.decide(name) for name in names}
        agree = any(mode != "off" for mode, _ in decided.values())
        # Undo newest first: two patches may wrap the same attribute (the later one's wrapper outside the
        # earlier one's), and each puts back only what it set itself.
        for name in reversed(names):
            state = _states[name]
            if not state.sticky and decided[name][0] == "off":
                _undo(name, state, DISABLED, decided[name][1])
        for name in names:
            state = _states[name]
            if state.sticky:  # its target changed or it failed: stays skipped/failed
                continue
            mode, why = decided[name]
            if mode == "off":
                continue
            if state.state == DISABLED or state.mode != mode:
                state.state, state.reason = PENDING, ""
                state.undo_after = None  # wanted again before another thread's apply ended: keep what it did
            state.mode, state.why = mode, why
            if state.gate is not None and not _gate(_load(name), state):  # gate known already
                continue
            for module_name in _targets(name)[0]:
                if module_name not in state.done and (name, module_name) not in _waiting:
                    _waiting.add((name, module_name))
                    watch.append((name, module_name))
            _refresh(name, state)
    if agree:
        _agree.install()  # every rank with zeroshim on says what it decided, before engines are built
    else:
        _agree.uninstall()
    for name, module_name in watch:  # in the registry's order: patches wrapping one attribute stack as listed
        _watch(name, module_name)


def gate_verdict(patch: Patch) -> "Tuple[bool, str]":
    """Is the bug a patch fixes present here?  The version ranges in
    ``affects``; where the patch declares a source fingerprint and the source
    can be read, the fingerprint decides (a vendor build with the fix
    backported, or a fork with another version number), and the reason says
    so when the two disagree.  Imports nothing."""
    affected, reason = _versions.check_affected(patch.affects)
    fingerprint = patch.fingerprint
    if fingerprint is None or reason.endswith(" is not installed"):
        return affected, reason
    from . import _source

    bug, seen = _source.check(fingerprint)
    if bug is None:
        return affected, f"{reason} (source fingerprint not checked: {seen})"
    if bug == affected:
        return affected, f"{reason}; the source agrees: {seen}"
    if bug:
        return True, (f"affected: {seen}, although the version says {reason.removeprefix('not affected: ')} "
                      "(a build with another version number?)")
    return False, (f"not affected: {seen}, although the version says {reason.removeprefix('affected: ')} "
                   "(a build with the fix?)")


_said_tested: list = []  # once per process (the gates run under _lock)


def _say_tested() -> None:
    """zeroshim's first line at INFO, at the first version gate it evaluates (whatever the verdicts): the
    newest releases it was tested on, and any installed one that is newer.  Read once per process."""
    if not _said_tested and log.isEnabledFor(logging.INFO):
        from . import __version__

        _said_tested.append(True)
        _log.info("zeroshim %s: %s", __version__, _versions.tested_line())


def _gate(patch: Patch, state: _State) -> bool:
    """Check the gate (once); False (and SKIPPED) if not affected."""
    if state.mode == "on":
        state.reason = f"forced on by {state.why} (version gate ignored)"
        return True
    if state.gate is None:
        _say_tested()
        state.gate = gate_verdict(patch)
    affected, reason = state.gate
    if not affected:
        _undo(patch.name, state, SKIPPED, reason)
        return False
    if state.state == SKIPPED:
        state.state = PENDING
    state.reason = reason
    return True


def _watch(name: str, module_name: str) -> None:
    """Patch ``module_name`` for ``name`` at once if it is imported, else when its import ends (the caller
    added ``(name, module_name)`` to ``_waiting``; not under ``_lock``)."""
    _hooks.register(module_name, lambda module: _on_import(name, module_name, module))


def _on_import(name: str, module_name: str, module: object) -> None:
    """A target of patch ``name`` finished importing: patch it.  Decided under ``_lock``, applied outside it
    (issue #47 item 4): an apply function may import (a DeepSpeed submodule), and another thread importing that
    module fires hooks that need ``_lock`` while it holds the module's import lock -- applying under ``_lock``
    deadlocked there.  One thread applies a given patch at a time; targets of it that arrive meanwhile (from
    another thread, or from an import inside its own apply function) are applied by that thread next.  The
    patch's own module is imported here, outside ``_lock``, where ``import zeroshim`` did not."""
    if name not in _states:  # deregistered meanwhile
        return
    if name in _declared:
        try:
            _load(name)
        except Exception as exc:  # never break the user's import
            with _lock:
                state = _states.get(name)
                if state is not None and not state.sticky:
                    _undo(name, state, FAILED, f"its module could not be imported: {exc!r}")
                    state.sticky = True
            _log.warning("zeroshim: could not import patch %s; it is left off", name,
                         exc_info=(type(exc), exc, exc.__traceback__))
            return
        if name in _stale:  # the index named other targets: watch the ones it did not name
            _stale.discard(name)
            sync()
    with _lock:
        _waiting.discard((name, module_name))
        state = _states.get(name)
        if state is None:
            return
        if state.busy is not None:
            state.queued.append((module_name, module))
            return
        state.busy = threading.get_ident()
    todo = [(module_name, module)]
    try:
        while todo:
            _apply_target(name, *todo.pop(0))
            with _lock:
                todo.extend(state.queued)
                state.queued.clear()
                if not todo:
                    _idle(name, state)
    finally:
        with _lock:
            if state.busy == threading.get_ident():  # an error escaped: never leave the patch marked busy
                state.queued.clear()
                _idle(name, state)


def _idle(name: str, state: _State) -> None:
    """This thread is done applying patch ``name`` (under ``_lock``): an undo asked for meanwhile that no
    apply of it has carried out yet is done now."""
    state.busy = None
    if state.undo_after is not None:
        new_state, reason = state.undo_after
        state.undo_after = None
        state.state = PENDING  # (``_undo`` set the new state already; it undoes what was applied now)
        _undo(name, state, new_state, reason)


def _apply_target(name: str, module_name: str, module: object) -> None:
    with _lock:
        patch, state = _patches.get(name), _states.get(name)
        if patch is None or state is None or state.state not in (PENDING, APPLIED) or module_name in state.done \
                or module_name not in patch.targets:  # (a target a stale index named)
            return  # (an optional target may arrive after the patch is applied)
        try:
            if not _gate(patch, state):
                return
        except Exception as exc:  # never break the user's import
            _failed(patch, state, module_name, exc)
            return
        if state.patcher is None:
            state.patcher = Patcher(name)
        patcher, apply_fn = state.patcher, patch.targets[module_name]
    try:
        apply_fn(module, patcher)
    except NotAffected as exc:
        with _lock:
            _undo(name, state, SKIPPED, f"not affected: {exc}")
            state.sticky = True
        return
    except TargetChanged as exc:
        with _lock:
            _undo(name, state, SKIPPED, f"target changed: {exc}")
            state.sticky = True
        _log.warning("zeroshim: skipped %s: %s", name, state.reason)
        return
    except Exception as exc:  # never break the user's import
        with _lock:
            _failed(patch, state, module_name, exc)
        return
    with _lock:
        state.done.add(module_name)
        if state.undo_after is None:  # (turned off meanwhile: _idle undoes all of it when this thread is done)
            _refresh(name, state)


def _failed(patch: Patch, state: _State, module_name: str, exc: Exception) -> None:
    _undo(patch.name, state, FAILED, f"error while patching {module_name}: {exc!r}")
    state.sticky = True
    _log.warning("zeroshim: could not apply %s; it is left off", patch.name, exc_info=(type(exc), exc,
                                                                                      exc.__traceback__))


def _refresh(name: str, state: _State) -> None:
    targets, optional = _targets(name)
    if state.state == PENDING and state.done.issuperset(set(targets) - optional):
        patch = _load(name)
        state.state = APPLIED
        _log.info("zeroshim: applied %s (%s): %s", name, state.reason, patch.summary)


def _forget(name: str) -> None:
    """What every patch's undo resets, one mechanism for all: its counters (``stats``, in place, to what they
    were when it was imported) and its once-only messages (applied again later, it says so again)."""
    _log.forget_patch(name)
    initial = _initial_stats.get(name)
    stats = getattr(_modules.get(name), "stats", None)
    if initial is not None and isinstance(stats, dict):
        from copy import deepcopy

        for key in [key for key in stats if key not in initial]:
            del stats[key]
        stats.update(deepcopy(initial))  # (never empty meanwhile: a wrapper counting in another thread finds its key)


def _undo(name: str, state: _State, new_state: str, reason: str) -> None:
    if state.busy is not None and state.busy != threading.get_ident():
        # another thread is applying this patch: it undoes what it applied when its apply returns; from now
        # on the patch is not active (its wrappers pass calls through)
        state.undo_after = (new_state, reason)
        state.state, state.reason = new_state, reason
        return
    was_applied = bool(state.done)
    if state.patcher is not None:
        state.patcher.undo()
        state.patcher = None
    state.done.clear()
    if was_applied:
        _forget(name)
        patch = _patches.get(name)  # (imported: it applied)
        if patch is not None and patch.on_undo is not None:
            patch.on_undo()
    if was_applied or state.state != new_state:
        log.debug("zeroshim: %s is %s: %s", name, new_state, reason)
    state.state, state.reason = new_state, reason


# -- other libraries replacing what a patch wraps ------------------------------------
def _bypassed(patch: Patch, state: _State) -> "Optional[str]":
    """For an applied patch with a ``bypass`` probe: what replaced its targets
    (None while its wrappers are still reached).  Logged once per finding."""
    if state.state != APPLIED or patch.bypass is None:
        return None
    try:
        found = patch.bypass()
    except Exception:  # a probe's own failure says nothing about the patch
        log.debug("zeroshim: bypass probe of %s failed", patch.name, exc_info=True)
        return None
    if found:
        _log.warning("zeroshim: %s is applied but BYPASSED: %s", patch.name, found, once=("bypass", patch.name, found))
    return found or None


def check_bypasses() -> "Dict[str, str]":
    """Run every applied patch's bypass probe now (at engine creation and at an
    engine's first forward, and by :func:`status`); ``{patch: finding}``."""
    with _lock:
        found = {}
        for name in _known():  # (an applied patch is imported)
            patch = _patches.get(name)
            finding = _bypassed(patch, _states[name]) if patch is not None else None
            if finding:
                found[name] = finding
        return found


# -- dependencies between patches ----------------------------------------------------
def missing_dependency(name: str) -> "Optional[Tuple[str, str, str]]":
    """For a patch with ``needs``: the first needed patch whose bug exists here
    (its version gate says affected) but which is not active, as ``(needed
    patch, when it is needed, why it is not active)``; None if every needed
    patch is active or its bug is absent here."""
    needs = get_patch(name).needs
    for dep in needs:  # their declarations, imported before taking _lock
        if dep in _declared:
            _load(dep)
    with _lock:
        for dep, when in needs.items():
            patch, state = _patches.get(dep), _states.get(dep)
            if patch is None or state is None:
                return dep, when, "it is not registered"
            if state.state in (APPLIED, PENDING) or state.reason.startswith("not affected"):
                continue
            if not gate_verdict(patch)[0]:
                continue  # off, failed or changed, but the bug it fixes is absent here anyway
            return dep, when, f"{dep} is {state.state}: {state.reason}"
        return None


# -- introspection --------------------------------------------------------------------
def status(name: Optional[str] = None) -> Dict[str, PatchStatus]:
    """Per patch: state (applied / bypassed / pending / skipped / disabled /
    failed) and why."""
    with _lock:
        out = {}
        for patch_name, patch in load_patches().items():
            if name is not None and patch_name != name:
                continue
            state = _states[patch_name]
            if state.state == PENDING and not state.sticky:
                _gate(patch, state)
            waiting = tuple(m for m in patch.targets if m not in state.done and m not in patch.optional) \
                if state.state == PENDING else ()
            bypass = _bypassed(patch, state)
            if bypass:
                out[patch_name] = PatchStatus(patch_name, BYPASSED, f"{bypass} (wrappers applied: {state.reason})",
                                              patch.flag)
            else:
                out[patch_name] = PatchStatus(patch_name, state.state, state.reason, patch.flag, waiting)
        return out


def is_applied(name: str) -> bool:
    """True while every target of the patch is patched."""
    with _lock:
        return _states[name].state == APPLIED


def is_active(name: str) -> bool:
    """True while the patch is wanted (applied or pending): wrappers that outlive
    an undo (stacked under another wrapper) check this and pass straight through."""
    with _lock:
        return _states[name].state in (APPLIED, PENDING)


def report() -> str:
    """A human-readable table of :func:`status`."""
    rows = [(s.name, s.state, s.reason + (f" (waiting for {', '.join(s.waiting_for)})" if s.waiting_for else ""))
            for s in status().values()]
    width = max((len(r[0]) for r in rows), default=4)
    return "\n".join(f"{n:<{width}}  {st:<8}  {why}" for n, st, why in rows)
