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
    ``from_pretrained`` only in 4.57.0 to 4.57.6; 5.3.0 on call
    ``initialize_weights_zero3``.  Run: 5.0.0, 5.2.0 and 4.57.6 keep the
    default initialisation or fail (embedding std 1.02, q_proj 0.099); 5.3.0,
    5.23.0 and 4.49.0 initialise (0.020, 0.019).  Any DeepSpeed with ZeRO-3.
    The source fingerprint: ``smart_apply`` in ``modeling_utils`` and no
    ``initialize_weights_zero3``.

Flag
    ``ZEROSHIM_ZERO3_FROM_CONFIG_INIT=auto|on|off`` (default ``auto``).

Fix
    ``PreTrainedModel._initialize_weights`` (transformers calls it once per
    module, children first, from ``post_init`` and from ``from_pretrained``)
    is wrapped: where the module is not initialised yet and some of the
    parameters its ``_init_weights`` may set (its own, its plain children's)
    are empty ZeRO-3 shards, it runs with those gathered
    (``GatheredParameters(modifier_rank=0)``): every rank initialises (the
    same random draws, the same marks) and rank 0's values go to every rank's
    shard on exit.  That is what DeepSpeed's gathering ``Module.apply`` did
    for 4.51 and earlier, and what 5.3 does after the build.  Nothing changes
    where the parameters are already whole (no ZeRO-3, transformers' own
    gathers, 4.51 and earlier, 5.3 and later).  The weights then follow the
    model's ``_init_weights`` as without ZeRO-3; the random draws are not
    those of a build without ZeRO-3 from the same seed (building under
    ``zero.Init`` ran torch's default initialisation first, which drew from
    the generator).  It changes the run's numbers (the initial weights) and
    adds one gather per module, so every rank must take the same decision:
    the ranks agree before the first gather (the ranks-agree check), and a
    split stops the run.  One WARNING per job.

Undo
    ``zeroshim.unpatch("zero3_from_config_init")`` restores ``_initialize_weights``.
"""

from __future__ import annotations

from zeroshim import _agree, _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "zero3_from_config_init"
#: modules: modules whose _initialize_weights ran with their parameters gathered; parameters: how many were gathered
stats = {"modules": 0, "parameters": 0}


def _placeholders(module, pretrained_cls) -> list:
    """The ZeRO-3 parameters ``_init_weights(module)`` may set that are partition placeholders now: the module's
    own and its plain children's (not sub-models': they initialise themselves), as transformers 5.3+ gathers them.
    Parameters already gathered (DeepSpeed's ``Module.apply`` override, transformers' own gathers) are left out."""
    params = list(module.parameters(recurse=False))
    params += [p for child in module.children() if not isinstance(child, pretrained_cls)
               for p in child.parameters(recurse=False)]
    return [p for p in params if hasattr(p, "ds_id") and getattr(getattr(p, "ds_status", None), "name", None)
            not in (None, "AVAILABLE")]


def _make_initialize_weights(module):
    pretrained_cls = module.PreTrainedModel

    def _initialize_weights(wrapped, instance, args, kwargs):
        """Wraps ``PreTrainedModel._initialize_weights(module, ...)`` (called once per module, children first)."""
        params = None
        with guard(NAME):
            target = args[0] if args else kwargs.get("module")
            if is_active(NAME) and target is not None and not getattr(target, "_is_hf_initialized", False):
                params = _placeholders(target, pretrained_cls) or None
                if params and not _agree.before_acting(NAME, "initialising ZeRO-3 partitioned weights gathered"):
                    params = None  # the ranks turned it off
        if params is None:
            return wrapped(*args, **kwargs)
        import deepspeed

        # every rank initialises (the same draws, the same marks); rank 0's values are sent to every rank's shard
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            result = wrapped(*args, **kwargs)
        with guard(NAME):
            stats["modules"] += 1
            stats["parameters"] += len(params)
            _log.acted(NAME, "ran the model's _init_weights on ZeRO-3 partitioned parameters gathered, module by "
                             "module (rank 0's values sent to every rank)",
                       "transformers %s runs it on empty ZeRO-3 shards here: the weights keep torch's defaults or "
                       "uninitialised memory, and an embedding's padding row fails with IndexError (fixed in 5.3.0)",
                       _versions.shown("transformers"))
        return result

    return _initialize_weights


def patch_modeling_utils(module, patcher: Patcher) -> None:
    cls = require_attr(module, "PreTrainedModel")
    for name in ("_initialize_weights", "_init_weights", "initialize_weights"):
        require_attr(cls, name)
    patcher.wrap(cls, "_initialize_weights", _make_initialize_weights(module))


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
