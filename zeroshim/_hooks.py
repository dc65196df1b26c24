"""Post-import hooks: run a callback the moment a module finishes importing.

The same design as wrapt's ``importer`` module (a ``sys.meta_path`` finder that
wraps the real loader and fires hooks after ``exec_module``), written out here
because ``import wrapt`` pulls in asyncio on wrapt 2.x (~40 ms), and
``import zeroshim`` has to stay nearly free.  wrapt itself is imported only
when a patch actually wraps something, i.e. after torch or deepspeed has been
imported anyway.
"""

from __future__ import annotations

import sys
import threading

_lock = threading.RLock()
_hooks: dict = {}  # module name -> [hook(module), ...]
_fired: dict = {}  # module name -> the module object whose hooks have fired (its import may still be finishing)
_loading: set = set()  # names whose import a _Loader is running now (it fires their hooks at its end)
_local = threading.local()


def _initializing(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def register(name: str, hook) -> None:
    """Call ``hook(module)`` once module ``name`` is imported: now, if it already
    is, else right after its import finishes.

    Decided under the lock, so that no import can end between the check and the
    registration with the hook left behind: an import whose hooks already fired
    counts as done.  A module another thread is importing through a loader this
    module did not wrap (it started before any hook asked for it) is waited for
    in a small daemon thread, which fires the hooks when that import ends."""
    with _lock:
        module = sys.modules.get(name)
        ready = module is not None and (not _initializing(module) or _fired.get(name) is module)
        if not ready:
            _hooks.setdefault(name, []).append(hook)
            _install()
            orphan = name not in _loading and (module is not None or _import_in_flight(name))
    if ready:
        hook(module)
    elif orphan:
        _await(name)


def _import_in_flight(name: str) -> bool:
    """Whether some thread is importing ``name`` now: Python holds a per-module import lock from before the
    module is looked for until it is executed (``importlib._bootstrap._module_locks``; CPython 3.11 to 3.13).
    False where that cannot be read."""
    import importlib._bootstrap as bootstrap

    locks = getattr(bootstrap, "_module_locks", None)
    try:
        return isinstance(locks, dict) and name in locks and locks[name]() is not None
    except Exception:  # a weak reference gone meanwhile
        return False


def _await(name: str) -> None:
    """Fire ``name``'s hooks once the import of it that another thread started, through a loader no _Loader
    wraps, has ended (waiting on Python's own lock for that module where it can, else polling)."""
    import time

    def wait():
        import importlib._bootstrap as bootstrap

        manager = getattr(bootstrap, "_ModuleLockManager", None)
        if manager is not None:
            try:
                with manager(name):
                    pass
            except Exception:  # a deadlock Python detected, or a changed private API: poll instead
                manager = None
        deadline = time.monotonic() + 600
        while manager is None and time.monotonic() < deadline:
            module = sys.modules.get(name)
            if module is not None and not _initializing(module):
                break
            time.sleep(0.005)
        module = sys.modules.get(name)
        if module is not None and not _initializing(module):  # else the import failed: the next one fires
            _fire(name)

    threading.Thread(target=wait, name=f"zeroshim-import-{name}", daemon=True).start()


def _fire(name: str) -> None:
    with _lock:
        hooks = _hooks.pop(name, [])
        module = sys.modules.get(name)
        if module is not None:
            _fired[name] = module
    if module is None:
        return
    for hook in hooks:
        hook(module)  # the hooks zeroshim registers never raise


def _install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Loader:
    """Delegates to the real loader, then fires the hooks."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # The module should see its real loader (inspect/linecache use it).
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        name = module.__name__
        with _lock:
            _loading.add(name)
        try:
            self.loader.exec_module(module)
        finally:
            with _lock:
                _loading.discard(name)
        _fire(name)


class _Finder:
    """Finds nothing itself: for a watched name it asks the finders after it on
    ``sys.meta_path`` and wraps the loader they return."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _hooks:
            return None
        busy = getattr(_local, "busy", None)
        if busy is None:
            busy = _local.busy = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader)
        return spec
