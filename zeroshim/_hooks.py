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
_local = threading.local()


def register(name: str, hook) -> None:
    """Call ``hook(module)`` once module ``name`` is imported: now, if it already
    is, else right after its import finishes."""
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        hook(module)
        return
    with _lock:
        _hooks.setdefault(name, []).append(hook)
        _install()


def _fire(name: str) -> None:
    with _lock:
        hooks = _hooks.pop(name, [])
    module = sys.modules.get(name)
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
        self.loader.exec_module(module)
        _fire(module.__name__)


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
