"""Find parameters, buffers and submodules registered on a DeepSpeed engine, instead of recursing until Python stops,
as DeepSpeed 0.19.6 does.

Symptom
    Reading an attribute of a ``DeepSpeedEngine`` that was registered on the engine itself as a submodule, parameter
    or buffer (``engine.head = nn.Linear(...)``, ``engine.register_buffer(...)``, DeepSpeed's own HybridEngine
    workspace with ``"release_inference_cache": true``), or a property of the engine that raises
    ``AttributeError``, or any attribute before ``nn.Module.__init__`` has run (a subclass, or a wrapper of
    ``__init__``), fails with ``RecursionError: maximum recursion depth exceeded`` and a traceback of a
    thousand ``engine.py ... in __getattr__ ... return getattr(self, name)`` frames (DeepSpeed PR #8288; #6534,
    #4440, #2023 and transformers #21326 show the same frames).  The name exists, so the user's real mistake, if
    any, is hidden behind the recursion.

Cause
    ``DeepSpeedEngine.__getattr__`` (reached only when the normal lookup failed) returns ``getattr(self, name)``
    whenever ``name in dir(self)``.  ``nn.Module.__dir__`` lists registered parameters, buffers and submodules,
    which live in ``_parameters``, ``_buffers`` and ``_modules``, where only ``nn.Module.__getattr__`` finds them;
    DeepSpeed's override never asks it, so ``getattr`` lands in ``__getattr__`` again.  DeepSpeed 0.19.6 asks
    ``nn.Module.__getattr__`` first, then the wrapped module.

Affected versions
    DeepSpeed < 0.19.6, read from the released sdists: ``if name in dir(self): return getattr(self, name)`` is in
    0.12.3, 0.14.1, 0.16.9, 0.18.5 and 0.19.5 (the source fingerprint); 0.19.6 has the new lookup.  Reproduced on
    CPU on 0.19.2 (a registered submodule and buffer); 0.19.8 returns them.

Flag
    ``ZEROSHIM_ENGINE_GETATTR_RECURSION=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine.__getattr__`` is wrapped.  Where the name is one the old code would look up on the engine
    again (a class attribute, or a registered parameter, buffer or submodule: what ``dir(self)`` adds), zeroshim
    answers as 0.19.6: ``nn.Module.__getattr__`` (the registered object), else the wrapped module's attribute,
    else ``AttributeError: 'DeepSpeedEngine' object has no attribute '<name>'`` (a direct
    ``engine.__getattr__(name)`` call for a name the normal lookup finds keeps the old answer).  Every other name,
    registered names that start with a digit included (``dir`` leaves them out, so the old code never recursed on
    them; 0.19.6 returns them), goes to DeepSpeed's own ``__getattr__`` as before (the wrapped module's attribute,
    or its AttributeError).  What it
    changes: a lookup that would have recursed until ``RecursionError`` returns the object, or raises
    ``AttributeError``.

Undo
    ``zeroshim.unpatch("engine_getattr_recursion")`` restores ``__getattr__``.

Evidence
    benchmarks/RESULTS.md, ``engine_getattr_recursion``.
"""

from __future__ import annotations

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr
from zeroshim._source import Fingerprint

NAME = "engine_getattr_recursion"
#: answered: lookups answered as DeepSpeed 0.19.6 where DeepSpeed would have recursed
stats = {"answered": 0}


def would_recurse(engine, name: str) -> bool:
    """Would DeepSpeed < 0.19.6's ``__getattr__`` call ``getattr(self, name)`` again?  It does where ``name in
    dir(self)``; ``__getattr__`` is reached only after the normal lookup failed, so what ``dir`` adds that can reach
    here is a class attribute (a property that raised AttributeError) or a registered parameter, buffer or
    submodule; and before ``nn.Module.__init__`` has run, every name (``dir`` reads ``self._parameters``).  Read
    from the instance's own dict and its class, without a lookup that could land here again."""
    own = engine.__dict__
    if "_parameters" not in own:
        return True  # before nn.Module.__init__: dir(self) itself reads self._parameters, landing here again
    # nn.Module.__dir__ leaves out registered names that start with a digit (nn.Sequential's "0"): the old code
    # does not look those up again, and answers as before
    for store in ("_parameters", "_buffers", "_modules"):
        registered = own.get(store)
        if registered is not None and name in registered and not name[:1].isdigit():
            return True
    return any(name in vars(klass) for klass in type(engine).__mro__)


def _getattr(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine.__getattr__(name)``."""
    name = args[0] if args else kwargs.get("name")
    recursing = False
    with guard(NAME):
        recursing = is_active(NAME) and isinstance(name, str) and would_recurse(instance, name)
    if not recursing:
        return wrapped(*args, **kwargs)
    import torch

    with guard(NAME):
        stats["answered"] += 1
        _log.acted(NAME, "answered engine.%s as DeepSpeed 0.19.6 does", "DeepSpeed %s would look it up on the engine "
                   "again until RecursionError", name, _versions.shown("deepspeed"))
    try:  # a direct engine.__getattr__(name) call for a name the normal lookup finds: the old code's answer
        return object.__getattribute__(instance, name)
    except AttributeError:
        pass
    try:
        return torch.nn.Module.__getattr__(instance, name)
    except AttributeError:
        pass
    module = instance.__dict__.get("module")
    if module is None:  # assigned through nn.Module.__setattr__: registered only (0.19.6 looks there too)
        module = (instance.__dict__.get("_modules") or {}).get("module")
    if module is not None:
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"'{type(instance).__name__}' object has no attribute '{name}'")


def patch_engine(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedEngine")
    require("__getattr__" in vars(cls), "DeepSpeedEngine defines no __getattr__ of its own")
    patcher.wrap(cls, "__getattr__", _getattr)


PATCH = Patch(
    changes=("error",),  # a lookup that recursed until RecursionError returns the object, or raises AttributeError
    name=NAME,
    summary="an attribute registered on a DeepSpeed engine (a submodule, parameter or buffer; HybridEngine's "
            "workspace) or an engine property that raises AttributeError: \"RecursionError: maximum recursion "
            "depth exceeded\" from engine.py's __getattr__",
    # the message, and DeepSpeed's __getattr__ calling itself in the traceback
    signatures=((r"RecursionError: maximum recursion depth exceeded",
                 r"engine\.py\", line \d+, in __getattr__\s+return getattr\(self, name\)"),),
    affects={"deepspeed": "<0.19.6"},
    fingerprint=Fingerprint("deepspeed.runtime.engine", r"if name in dir\(self\):\s*return getattr\(self, name\)",
                            "__getattr__ looking a name of dir(self) up on the engine again (0.19.6 asks "
                            "nn.Module.__getattr__)"),
    targets={"deepspeed.runtime.engine": patch_engine},
)
