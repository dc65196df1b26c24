"""Keep a ZeRO-3 ``HfDeepSpeedConfig`` that user code built and dropped before transformers read it.

Symptom
    None: the model loads, every rank just holds all of it.  A script that
    builds ``HfDeepSpeedConfig(ds_config)`` (ZeRO-3) in a helper and does not
    keep the object gets ``from_pretrained`` / ``from_config`` without
    ``deepspeed.zero.Init``: nothing is partitioned at load time, so each rank
    materialises the whole model (a large model runs out of memory; a small
    one is partitioned later by ``deepspeed.initialize``, after the peak).
    LLaMA-Factory, axolotl,
    OpenRLHF and xtuner keep the object alive by hand for this reason.

Cause
    ``HfDeepSpeedConfig.__init__`` registers itself with
    ``set_hf_deepspeed_config``, which stores only ``weakref.ref(obj)`` in the
    module global ``_hf_deepspeed_config_weak_ref``;
    ``is_deepspeed_zero3_enabled()`` and ``deepspeed_config()`` answer
    "not ZeRO-3" / ``None`` once the object is gone.  transformers' docs say
    the object must be kept alive; nothing warns when it is not.  The Trainer
    path is not affected: ``TrainingArguments`` keeps its
    ``HfTrainerDeepSpeedConfig`` on ``args.hf_deepspeed_config`` (and
    accelerate's ``DeepSpeedPlugin`` keeps its own on ``dschf``/``hf_ds_config``).

Affected versions
    transformers ``>=4.33.0`` as patched here (``transformers.integrations.deepspeed``
    first shipped in 4.33.0; 4.32.1 has only ``transformers/deepspeed.py``).
    The weak reference itself is older: 4.5.1 has no ZeRO-3 loading, 4.6.0
    brings it with ``weakref.ref`` in ``transformers/integrations.py``
    (``deepspeed_config_hf_set``); 4.33.0, 4.49.0, 4.57.6, 5.0.0, 5.23.0 and
    5.24.0 (the newest release) all store ``weakref.ref(hf_deepspeed_config_obj)``
    (read from the released wheels).  No release holds it strongly.  The
    source fingerprint is that line.

    Dropping the object is not always an accident.  DeepSpeed-Chat's
    ``create_hf_model`` and OpenRLHF's ``Actor`` build it in function scope
    "to avoid global effects": it lives for that function's load and dies at
    its return, so a later load without a config is not partitioned.
    accelerate < 1.0 (0.34.2 read) turns ``zero.Init`` off in
    ``DeepSpeedPlugin.zero3_init_context_manager(enable=False)`` the same way
    (``self.dschf = None``, no new config); accelerate 1.0.0+ calls
    ``unset_hf_deepspeed_config()`` and builds a new one.  transformers
    documents no off switch other than not having a config;
    ``unset_hf_deepspeed_config()`` (exported from ``transformers.integrations``)
    is what accelerate calls.

Flag
    ``ZEROSHIM_ZERO3_HF_CONFIG_WEAKREF=auto|on|off`` (default ``auto``).

Fix
    Only where the loss is evidently accidental: a ZeRO-3 ``HfDeepSpeedConfig``
    built by user code (the constructor was not called from transformers or
    accelerate, which keep theirs), still the one transformers holds, that
    dies before transformers ever read it (no ``is_deepspeed_zero3_enabled()``
    / ``deepspeed_config()`` returned it: nobody builds a ZeRO-3 config to
    throw it away unread).  Then zeroshim keeps it, so the next load is
    partitioned exactly as if the user had kept the object, until
    ``unset_hf_deepspeed_config()`` is called or a new ``HfDeepSpeedConfig``
    replaces it (both drop zeroshim's reference with transformers' own).
    A config that served a load and then died (the function-scope pattern
    above) is left to die, as without zeroshim.  How:
    ``HfDeepSpeedConfig.__init__`` is wrapped; after it returns, the global
    weak reference to a user-built config is replaced by a ``weakref.ref``
    subclass that notes when it is read; a ``__del__`` added to
    ``HfDeepSpeedConfig`` stores the dying object on that reference
    (resurrection, PEP 442; the weak reference is still intact at that
    point), and logs one WARNING per job (what, why, the flag).
    Not handled: a config dropped after user code itself called
    ``is_deepspeed_zero3_enabled()`` (it counts as read), one that dies in a
    reference cycle (the garbage collector clears weak references before
    finalizers), and ``HfDeepSpeedConfig`` subclasses with their own ``__del__``.

Undo
    ``zeroshim.unpatch("zero3_hf_config_weakref")`` restores ``__init__``,
    removes the ``__del__`` and puts a plain weak reference back (a config
    only zeroshim kept is then released, as without zeroshim).

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero3_hf_config_weakref``.
"""

from __future__ import annotations

import sys
import weakref

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, TargetChanged, guard, require, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "zero3_hf_config_weakref"
GLOBAL = "_hf_deepspeed_config_weak_ref"
#: watched: user-built ZeRO-3 configs whose weak reference zeroshim watches;
#: kept: configs that died unread and that zeroshim keeps (introspection and tests)
stats = {"watched": 0, "kept": 0}
_OWNERS = ("transformers", "accelerate")  # they keep the configs they build (args, DeepSpeedPlugin)
_SKIP = ("zeroshim", "wrapt")


class _WatchedRef(weakref.ref):
    """The weak reference transformers holds to a user-built config, noting reads; ``keep`` holds
    the config once it died unread (released with this reference: unset or replaced)."""

    __slots__ = ("read", "keep")

    def __init__(self, obj):
        super().__init__(obj)
        self.read = False
        self.keep = None

    def __call__(self):
        obj = super().__call__()
        if obj is not None:
            self.read = True
        return obj


def _module_name(frame) -> str:
    return frame.f_globals.get("__name__") or ""


def _built_by_user(instance) -> bool:
    """Was ``instance`` constructed outside transformers/accelerate?  The frame that called the
    outermost ``__init__`` of ``instance`` decides (subclass ``__init__`` chains are skipped)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = _module_name(frame)
        if name.split(".")[0] in _SKIP or (frame.f_code.co_name == "__init__"
                                            and frame.f_locals.get("self") is instance):
            frame = frame.f_back
            continue
        return name.split(".")[0] not in _OWNERS
    return False


def _is_zero3(obj) -> bool:
    is_zero3 = getattr(obj, "is_zero3", None)
    return bool(callable(is_zero3) and is_zero3())


def _make_init(module):
    def _init(wrapped, instance, args, kwargs):
        """Wraps ``HfDeepSpeedConfig.__init__``."""
        result = wrapped(*args, **kwargs)
        with guard(NAME):
            ref = getattr(module, GLOBAL, None)
            if (is_active(NAME) and type(ref) is weakref.ref and ref() is instance and _is_zero3(instance)
                    and _built_by_user(instance)):
                setattr(module, GLOBAL, _WatchedRef(instance))
                stats["watched"] += 1
        return result

    return _init


def _make_del(module):
    def __del__(self):  # added to HfDeepSpeedConfig (it has none of its own)
        with guard(NAME):
            if sys.is_finalizing() or not is_active(NAME):
                return
            ref = getattr(module, GLOBAL, None)
            if type(ref) is not _WatchedRef or ref.read or ref.keep is not None:
                return
            if weakref.ref.__call__(ref) is not self:  # the weak reference is intact until finalizers ran
                return
            ref.keep = self  # resurrected: lives as long as transformers' reference to it
            stats["kept"] += 1
            _log.acted(NAME, "kept a ZeRO-3 HfDeepSpeedConfig that was dropped before transformers read it, until "
                             "unset_hf_deepspeed_config() or a new HfDeepSpeedConfig (keep a reference to it yourself "
                             "to silence this)", "transformers holds it only by weak reference, so from_pretrained "
                             "would load the whole model on every rank without deepspeed.zero.Init")

    return __del__


def patch_integrations_deepspeed(module, patcher: Patcher) -> None:
    cls = require_attr(module, "HfDeepSpeedConfig")
    require_attr(module, "set_hf_deepspeed_config")
    require_attr(module, "unset_hf_deepspeed_config")
    require(hasattr(module, GLOBAL), f"{module.__name__}.{GLOBAL} does not exist")
    require_params(cls.__init__, "config_file_or_dict")
    if any("__del__" in vars(klass) for klass in cls.__mro__):
        raise TargetChanged(f"{cls.__qualname__} already defines __del__")
    patcher.wrap(cls, "__init__", _make_init(module))
    patcher.set(cls, "__del__", _make_del(module))

    def restore_plain_ref():
        ref = getattr(module, GLOBAL, None)
        if isinstance(ref, _WatchedRef):
            obj = weakref.ref.__call__(ref)
            setattr(module, GLOBAL, weakref.ref(obj) if obj is not None else None)

    patcher.on_undo(restore_plain_ref)


PATCH = Patch(
    changes=('memory', 'collectives'),
    name=NAME,
    summary="HfDeepSpeedConfig dropped before from_pretrained (held by weak reference only): the model loads "
            "without zero.Init, every rank holds all of it",
    signatures=(),  # silent: nothing is printed
    versions_note="every DeepSpeed; the weak reference dates from 4.6.0",
    affects={"transformers": ">=4.33.0"},
    fingerprint=Fingerprint("transformers.integrations.deepspeed",
                            r"_hf_deepspeed_config_weak_ref = weakref\.ref\(",
                            "set_hf_deepspeed_config storing only a weak reference to the HfDeepSpeedConfig",
                            bug_when="present"),
    targets={"transformers.integrations.deepspeed": patch_integrations_deepspeed},
)
