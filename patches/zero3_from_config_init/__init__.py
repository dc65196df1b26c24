"""Initialise a model built under ZeRO-3 with its own ``_init_weights``, on its real weights, not empty shards.

Symptom
    A model built from a config (``AutoModelForCausalLM.from_config``,
    ``Model._from_config``: pretraining from scratch, a new head or tower, a
    reward model's value head) while a ZeRO-3 DeepSpeed config is active
    (``HfDeepSpeedConfig``, or ``TrainingArguments(deepspeed=...)`` made
    first):

    * nothing fails, and the model keeps PyTorch's default initialisation:
      embeddings drawn from N(0, 1) instead of N(0, ``initializer_range``),
      linear layers from Kaiming-uniform (std 0.10 at width 32) instead of
      0.02.  Training starts from other weights than the model's authors
      chose (transformers PR #43847 and the report it cites);
    * or, where an embedding has a padding index (``pad_token_id`` set: BERT,
      Gemma, most configs), ``IndexError: index 0 is out of bounds for
      dimension 0 with size 0`` in ``_init_weights``
      (``module.weight.data[module.padding_idx].zero_()``; transformers
      #43638).

    ``from_pretrained`` under ZeRO-3 on transformers 4.57: the same
    ``IndexError`` for a model whose embedding with a padding index has a
    buffer (Gemma 3's scaled word embedding: transformers #41762,
    LLaMA-Factory #9445, ms-swift #6738), or whose embedding weights are
    missing from the checkpoint; weights missing from the checkpoint are
    otherwise left as whatever memory they were given, silently.

Cause
    transformers builds the model inside ``deepspeed.zero.Init``, which
    partitions each module's parameters as soon as the module is built.  From
    4.52 ``initialize_weights`` walks the modules with its own ``smart_apply``
    instead of ``Module.apply``, which DeepSpeed's ``zero.Init`` replaces by a
    version that gathers each module's parameters first; so ``_init_weights``
    runs on the empty shards: ``normal_`` on an empty tensor changes nothing,
    and indexing the padding row fails.  4.57's ``from_pretrained`` gathers
    the weights it is about to initialise from ``state_dict().values()``,
    detached tensors DeepSpeed does not recognise, so nothing is gathered, and
    every module with a non-persistent buffer counts as not loaded.
    transformers 5.3 (PR #44236) builds ``from_config`` models without that
    pass and initialises each module afterwards with its parameters gathered.

Affected versions
    transformers 4.52.0 to 5.2.x, read from the released wheels (29 of them,
    4.49.0 to 5.23.0): 4.49.0 to 4.51.3 initialise through ``Module.apply``
    (gathered by DeepSpeed); 4.52.0 to 5.2.0 through ``smart_apply`` on
    ``from_config`` (the padding-row crash in every one of them);
    ``from_pretrained`` only in 4.57.0 to 4.57.6; 5.3.0 and later call
    ``initialize_weights_zero3``.  Run: 5.0.0 and 4.57.6 keep torch's
    defaults or fail; 5.23.0 and 4.49.0 initialise (embedding std 0.020).
    Any DeepSpeed with ZeRO-3.  The source fingerprint: ``smart_apply`` in
    ``modeling_utils`` and no ``initialize_weights_zero3``.

Flag
    ``ZEROSHIM_ZERO3_FROM_CONFIG_INIT=auto|on|off`` (default ``auto``).

Fix
    ``PreTrainedModel._initialize_weights`` (once per module, children
    first) is wrapped, and so are ``_from_config`` and, on 4.57,
    ``_initialize_missing_keys``.  While a ZeRO-3 ``from_config`` builds (or
    4.57's ``from_pretrained`` initialises what it is about to load), a
    module whose parameters its ``_init_weights`` may set (its own, its
    plain children's) are empty shards is not initialised there: no
    collective in the middle of a build, where a rank with the patch off
    runs DeepSpeed's own broadcasts.  At the end of the build the ranks agree
    (the ranks-agree check; a split stops the run), and those modules'
    ``_initialize_weights`` run in transformers' order, each with those
    parameters gathered (``GatheredParameters(modifier_rank=0)``): every rank
    initialises (the same draws, the same marks) and rank 0's values go to
    every rank's shard on exit.  In 4.57's ``from_pretrained`` a module whose
    every empty parameter the checkpoint fills is marked initialised without
    a gather (the load that follows writes it, as without ZeRO-3); only the
    weights the checkpoint lacks are initialised, gathered.  Nothing changes
    where the parameters are whole (no ZeRO-3, transformers' own gathers,
    5.x ``from_pretrained``, 4.51 and earlier, 5.3 and later).  The weights
    then follow the model's ``_init_weights`` as without ZeRO-3; the random
    draws are not those of a build without ZeRO-3 from the same seed
    (building under ``zero.Init`` ran torch's default initialisation first,
    which drew from the generator).  Cost: one gather per module with
    parameters (a child's parameters twice: for it, and for its parent).
    Tied weights: the build ties ``lm_head`` to the embedding before this
    pass, so a parameter initialised earlier in the pass keeps its values (as
    without ZeRO-3, where the tie's source wins).  A load inside a watched
    build (a pretrained tower in a model's ``__init__``, 4.57) marks what it
    loads.  Not covered: an ``_init_weights`` that sets parameters below a
    module's direct children (some detection models: OmDet-Turbo, D-FINE,
    DAB-DETR, Grounding DINO, ESMFold) leaves those as upstream does.  A rank
    with the patch off has posted its decisions when it entered ``zero.Init``,
    so the acting ranks stop within seconds even where it went on into a
    collective (4.57: the load after a checkpoint that lacks weights; a script
    that resizes embeddings before its engine; tested).  One WARNING per job.

Undo
    ``zeroshim.unpatch("zero3_from_config_init")`` restores ``_initialize_weights``, ``_from_config`` and
    ``_initialize_missing_keys``.
"""

from __future__ import annotations

import contextlib
import threading

from zeroshim import _agree, _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, TargetChanged, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "zero3_from_config_init"
#: modules: modules initialised with their parameters gathered; parameters: how many were gathered; loaded: modules
#: of a from_pretrained whose every placeholder parameter the checkpoint fills (not initialised: no gather)
stats = {"modules": 0, "parameters": 0, "loaded": 0}
# per thread: the build or load zeroshim watches now (None: none): "pending", the (original call, module) pairs
# whose _init_weights would have run on empty shards, in transformers' order; "missing", for a from_pretrained, the
# ids of the parameters the checkpoint does not fill
_state = threading.local()


def _placeholders(module, pretrained_cls) -> list:
    """The ZeRO-3 parameters ``_init_weights(module)`` may set that are partition placeholders now: the module's
    own and its plain children's (not sub-models': they initialise themselves), as transformers 5.23 gathers them
    (some models' ``_init_weights`` set a child's weight).  Parameters already whole are left out."""
    params = list(module.parameters(recurse=False))
    params += [p for child in module.children() if not isinstance(child, pretrained_cls)
               for p in child.parameters(recurse=False)]
    return [p for p in params if hasattr(p, "ds_id") and getattr(getattr(p, "ds_status", None), "name", None)
            not in (None, "AVAILABLE")]


def _make_initialize_weights(module):
    pretrained_cls = module.PreTrainedModel

    def _initialize_weights(wrapped, instance, args, kwargs):
        """Wraps ``PreTrainedModel._initialize_weights(module, ...)`` (once per module, children first).  Inside a
        watched build or load, a module whose parameters are empty shards is not initialised now (no collective in
        the middle of a build, where a rank with the patch off would run another one): it is kept for the end."""
        pending = getattr(_state, "pending", None)
        if pending is None:
            return wrapped(*args, **kwargs)
        with guard(NAME):
            target = args[0] if args else kwargs.get("module")
            if target is not None and not getattr(target, "_is_hf_initialized", False) and is_active(NAME):
                params = _placeholders(target, pretrained_cls)
                missing = getattr(_state, "missing", None)
                if params and missing is not None and not any(id(p) in missing for p in params):
                    target._is_hf_initialized = True  # the checkpoint fills all of them, after this
                    stats["loaded"] += 1
                    return None
                if params:
                    seen = _state.seen
                    if id(target) not in seen:  # a sub-model's pass visits it again
                        seen.add(id(target))
                        pending.append((wrapped, target, args, kwargs))
                    return None
        return wrapped(*args, **kwargs)

    return _initialize_weights


def _finish(pending: list, pretrained_cls, where: str) -> None:
    """Initialise the modules kept during a build or load, in transformers' order, each with its empty shards
    gathered (rank 0's values sent to every rank's shard on exit); every rank initialises (the same draws, the
    same marks).  The ranks agree first: every rank is at the end of the same build or load."""
    if not pending or not _agree.before_acting(NAME, where):
        return
    import deepspeed
    import torch

    guard_init = contextlib.nullcontext()
    with contextlib.suppress(ImportError):  # transformers 5: torch's init functions respect its marks
        from transformers import initialization

        guard_init = initialization.guard_torch_init_functions()
    done, modules = set(), 0  # ids of the parameters initialised in this pass
    with torch.no_grad(), guard_init:
        for wrapped, target, args, kwargs in pending:
            params = _placeholders(target, pretrained_cls)
            if not params or getattr(target, "_is_hf_initialized", False):
                continue
            # a parameter initialised earlier in this pass is one the build tied to another module's (lm_head to
            # the embedding: post_init ties after it initialises, so without ZeRO-3 the tie's source keeps its
            # values): it keeps them here too
            again = [p for p in params if id(p) in done]
            if len(again) == len(params):
                target._is_hf_initialized = True
                continue
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                kept = [(p, p.data.clone()) for p in again]
                wrapped(*args, **kwargs)
                for p, data in kept:
                    p.data.copy_(data)
            done.update(id(p) for p in params)
            modules += 1
            stats["modules"] += 1
            stats["parameters"] += len(params)
    if modules:
        with guard(NAME):
            _log.acted(NAME, "ran the model's _init_weights on ZeRO-3 partitioned parameters gathered, module by "
                             "module, after %s (rank 0's values sent to every rank)",
                       "transformers %s runs it on empty ZeRO-3 shards: the weights keep torch's defaults or "
                       "uninitialised memory, and an embedding's padding row fails with IndexError (fixed in 5.3.0)",
                       where, _versions.shown("transformers"))


@contextlib.contextmanager
def _watching(missing=None):
    """Watch the build or load in this thread (the outermost one only: a sub-model's is part of it)."""
    if getattr(_state, "pending", None) is not None:
        yield None
        return
    _state.pending, _state.missing, _state.seen = [], missing, set()
    try:
        yield _state.pending
    finally:
        _state.pending = _state.missing = _state.seen = None


def _make_from_config(module):
    def _from_config(wrapped, instance, args, kwargs):
        """Wraps ``PreTrainedModel._from_config(config, **kwargs)`` (a classmethod: ``instance`` is the class)."""
        watch = False
        with guard(NAME):
            from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

            watch = is_active(NAME) and is_deepspeed_zero3_enabled() and getattr(_state, "pending", None) is None
        if not watch:
            return wrapped(*args, **kwargs)
        with _watching() as pending:
            model = wrapped(*args, **kwargs)
            _finish(pending, module.PreTrainedModel, "from_config")
        return model

    return _from_config


def _make_initialize_missing_keys(module):
    def _initialize_missing_keys(wrapped, instance, args, kwargs):
        """Wraps 4.57's ``PreTrainedModel._initialize_missing_keys(missing_keys, is_quantized)`` (the weights are
        loaded after it)."""
        missing = None
        with guard(NAME):
            names = args[0] if args else kwargs.get("missing_keys", ())
            if is_active(NAME):
                found = set()
                for name in names:
                    with contextlib.suppress(AttributeError):
                        found.add(id(instance.get_parameter_or_buffer(name)))
                missing = found
        if missing is None:
            return wrapped(*args, **kwargs)
        if getattr(_state, "pending", None) is not None:  # a load inside a watched build (a tower in __init__):
            outer, _state.missing = _state.missing, missing  # what it loads is marked; what it lacks, kept
            try:
                return wrapped(*args, **kwargs)
            finally:
                _state.missing = outer
        with _watching(missing) as pending:
            result = wrapped(*args, **kwargs)
            _finish(pending, module.PreTrainedModel, "from_pretrained's initialisation of the weights the "
                                                      "checkpoint lacks")
        return result

    return _initialize_missing_keys


def patch_modeling_utils(module, patcher: Patcher) -> None:
    import wrapt

    cls = require_attr(module, "PreTrainedModel")
    for name in ("_initialize_weights", "_init_weights", "initialize_weights"):
        require_attr(cls, name)
    params = list(_signature(cls._initialize_weights))
    if params != ["self", "module"]:  # 5.3+ adds is_remote_code and calls it on rank 0 only
        raise TargetChanged(f"PreTrainedModel._initialize_weights{tuple(params)} is not (self, module)")
    raw = vars(cls).get("_from_config")
    if not isinstance(raw, classmethod):
        raise TargetChanged("PreTrainedModel._from_config is not a classmethod")
    patcher.wrap(cls, "_initialize_weights", _make_initialize_weights(module))
    wrapper = wrapt.FunctionWrapper(raw, _make_from_config(module))  # bound per class, as the classmethod
    wrapper._self_zeroshim_patch = NAME
    patcher.set(cls, "_from_config", wrapper)
    if _gathers_detached_tensors(cls):  # 4.57: its from_pretrained gathers nothing
        require_attr(cls, "get_parameter_or_buffer")
        patcher.wrap(cls, "_initialize_missing_keys", _make_initialize_missing_keys(module))


def _signature(function) -> dict:
    import inspect

    return inspect.signature(inspect.unwrap(function)).parameters


def _gathers_detached_tensors(cls) -> bool:
    """Does ``_initialize_missing_keys(missing_keys, ...)`` gather ``state_dict().values()`` (4.57.x), detached
    tensors DeepSpeed does not recognise?  Read from its source (4.52-4.56 and 5.x gather parameters)."""
    import inspect
    import re

    method = getattr(cls, "_initialize_missing_keys", None)
    if method is None:
        return False
    try:
        source = inspect.getsource(inspect.unwrap(method))
    except (OSError, TypeError):  # no source to read: the releases read (4.57.0-4.57.6) decide
        return (_versions.installed("transformers") or "").startswith("4.57.")
    return bool(re.search(r"self\.state_dict\(\)\.values\(\)", source)) and \
        list(_signature(method))[:2] == ["self", "missing_keys"]


PATCH = Patch(
    changes=("numbers", "collectives"),  # a run that trains gets other initial weights (the crash is a side)
    on_disagreement="stop",  # without it the model keeps torch's defaults or uninitialised memory, silently
    name=NAME,
    summary="from_config() (4.52-5.2) and from_pretrained() (4.57) under ZeRO-3 run _init_weights on empty shards: "
            "torch's defaults or uninitialised weights (silent), or IndexError on a padding row",
    signatures=(
        # what makes it this bug: _init_weights indexing an embedding's padding row on an empty ZeRO-3 shard
        (r"IndexError: index \d+ is out of bounds for dimension 0 with size 0", r"padding_idx|_init_weights",
         r"(?i)deepspeed|zero"),
    ),
    affects={"transformers": ">=4.52.0,<5.3.0", "deepspeed": ""},
    versions_note="ZeRO-3",
    fingerprint=Fingerprint("transformers.modeling_utils",
                            r"\A(?=[\s\S]*\bsmart_apply\b)(?![\s\S]*initialize_weights_zero3)",
                            "initialize_weights by smart_apply (4.52+), which DeepSpeed's gathering Module.apply does "
                            "not see, without initialize_weights_zero3 (5.3.0, #44236)"),
    targets={"transformers.modeling_utils": patch_modeling_utils},
)
