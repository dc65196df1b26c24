"""Initialise a model built with ``from_config()`` under ZeRO-3 with its own ``_init_weights``, not torch's defaults.

Symptom
    Nothing fails.  A model built from a config (``AutoModelForCausalLM.from_config``,
    ``Model._from_config``: pretraining from scratch, a new head or tower, a
    reward model's value head) while a ZeRO-3 DeepSpeed config is active
    (``HfDeepSpeedConfig``, or ``TrainingArguments(deepspeed=...)`` made
    first) keeps PyTorch's default initialisation: embeddings drawn from
    N(0, 1) instead of N(0, ``initializer_range``), linear layers from
    Kaiming-uniform (std 0.10 at width 32) instead of 0.02.  Training starts
    from other weights than the model's authors chose, with larger losses and
    gradients (transformers PR #43847 and the report it cites).  Reported
    too, not reproduced here: models whose ``_init_weights`` needs a weight's
    shape fail instead ("Fan in and fan out can not be computed for tensor
    with fewer than 2 dimensions").

Cause
    transformers 5.0 builds the model inside ``deepspeed.zero.Init``, which
    partitions each module's parameters as soon as the module is built: the
    weights the model's ``post_init`` then initialises are empty shards, so
    ``_init_weights`` changes nothing and marks every module initialised.
    transformers 5.3 (PR #44236) suppresses that pass and initialises each
    module again afterwards with its parameters gathered.

Affected versions
    transformers 5.0.0 to 5.2.x, read from the released wheels: 5.0.0, 5.1.0
    and 5.2.0 build under ``zero.Init`` and do not initialise again; 5.3.0
    and 5.4.0 call ``initialize_weights_zero3``.  Run: 5.0.0 and 5.2.0 keep
    the default initialisation (embedding std 1.02, q_proj 0.099); 5.3.0,
    5.23.0 and 4.49.0 initialise (0.020, 0.019).  4.x builds the model the
    same way but initialises it otherwise; 4.50 to 4.57 were not run.  Any
    DeepSpeed with ZeRO-3.  The source fingerprint: transformers' 5.x initialisation module imported in
    ``modeling_utils`` and no ``initialize_weights_zero3``.

Flag
    ``ZEROSHIM_ZERO3_FROM_CONFIG_INIT=auto|on|off`` (default ``auto``).

Fix
    ``PreTrainedModel._from_config`` is wrapped: where transformers built the
    model under ``zero.Init`` (ZeRO-3 active, not quantized, no
    ``zero.Init`` of the caller's), the modules' "initialised" marks left by
    the pass over empty shards are cleared and the model's own
    ``_initialize_weights`` runs again in transformers' order (children
    first, each sub-model with its own), each module's parameters and its
    direct children's gathered, rank 0 initialising and every rank receiving
    its shard (``GatheredParameters(modifier_rank=0)``).  The weights then
    follow the model's ``_init_weights`` as without ZeRO-3; the random draws
    are not those of a build without ZeRO-3 from the same seed (building
    under ``zero.Init`` ran torch's default initialisation first, which drew
    from the generator).  It changes the run's numbers (the initial weights) and adds one
    gather per module, so every rank must take the same decision: the ranks
    agree first (the ranks-agree check), and a split turns the patch off on
    every rank.  One WARNING per job.

Undo
    ``zeroshim.unpatch("zero3_from_config_init")`` restores ``_from_config``.
"""

from __future__ import annotations

import importlib

from zeroshim import _agree, _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, TargetChanged, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "zero3_from_config_init"
#: acted: models initialised again; modules: modules whose _initialize_weights ran again
stats = {"acted": 0, "modules": 0}


def _built_under_zero_init(module) -> bool:
    """Would ``_from_config`` build the model under ``zero.Init`` (transformers' own condition)?"""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return (is_deepspeed_zero3_enabled() and not getattr(module, "_is_quantized", False)
            and not getattr(module, "_is_ds_init_called", False))


def _initialise(model, pretrained_cls) -> int:
    """Run the model's ``_initialize_weights`` again in ``smart_apply`` order, each module's parameters (and its
    plain children's, which ``_init_weights`` may set) gathered, rank 0 writing.  The modules initialised."""
    import deepspeed
    import torch
    from transformers import initialization

    writer = torch.distributed.get_rank() == 0 if torch.distributed.is_initialized() else True
    for sub in model.modules():  # the pass over empty shards marked them initialised
        if getattr(sub, "_is_hf_initialized", False):
            sub._is_hf_initialized = False
    done = []

    def visit(module, initialise):
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, pretrained_cls) else initialise)
        params = list(module.parameters(recurse=False))
        params += [p for child in module.children() if not isinstance(child, pretrained_cls)
                   for p in child.parameters(recurse=False)]
        if params:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if writer:
                    initialise(module)
        else:
            initialise(module)
        module._is_hf_initialized = True
        done.append(module)

    with torch.no_grad(), initialization.guard_torch_init_functions():
        visit(model, model._initialize_weights)
    return len(done)


def _make_from_config(module):
    def _from_config(wrapped, instance, args, kwargs):
        """Wraps ``PreTrainedModel._from_config(config, **kwargs)`` (a classmethod: ``instance`` is the class)."""
        expected = False
        with guard(NAME):
            expected = is_active(NAME) and _built_under_zero_init(module)
        model = wrapped(*args, **kwargs)
        if expected and any(hasattr(p, "ds_id") for p in model.parameters()) \
                and _agree.before_acting(NAME, "initialising a model built with from_config under ZeRO-3"):
            with guard(NAME):
                modules = _initialise(model, module.PreTrainedModel)
                stats["acted"] += 1
                stats["modules"] += modules
                _log.acted(NAME, "initialising %s with its _init_weights after from_config under ZeRO-3 (%d "
                                 "modules gathered in turn)",
                           "transformers %s ran _init_weights on empty ZeRO-3 shards, which leaves torch's default "
                           "initialisation (fixed in 5.3.0)", type(model).__name__, modules,
                           _versions.shown("transformers"))
        return model

    return _from_config


def patch_modeling_utils(module, patcher: Patcher) -> None:
    import wrapt

    cls = require_attr(module, "PreTrainedModel")
    raw = vars(cls).get("_from_config")
    if not isinstance(raw, classmethod):
        raise TargetChanged("PreTrainedModel._from_config is not a classmethod")
    for name in ("_initialize_weights", "_init_weights"):
        require_attr(cls, name)
    require_attr(module, "_is_ds_init_called")
    require_attr(importlib.import_module("transformers.initialization"), "guard_torch_init_functions")
    wrapper = wrapt.FunctionWrapper(raw, _make_from_config(module))  # bound per class, as the classmethod
    wrapper._self_zeroshim_patch = NAME
    patcher.set(cls, "_from_config", wrapper)


PATCH = Patch(
    changes=("numbers", "collectives"),
    on_disagreement="stop",  # without it the model keeps torch's default initialisation, silently
    name=NAME,
    summary="from_config() under ZeRO-3 keeps torch's default initialisation instead of the model's _init_weights "
            "(silent)",
    signatures=(),  # silent (the crash variant reported upstream was not reproduced)
    affects={"transformers": ">=5.0.0,<5.3.0", "deepspeed": ""},
    versions_note="ZeRO-3",
    fingerprint=Fingerprint("transformers.modeling_utils",
                            r"(?m)\A(?=[\s\S]*^from \. import initialization as init$)"
                            r"(?![\s\S]*initialize_weights_zero3)",
                            "transformers 5's initialisation module without initialize_weights_zero3"),
    targets={"transformers.modeling_utils": patch_modeling_utils},
)
