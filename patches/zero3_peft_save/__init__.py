"""Save peft adapters with their full tensors under ZeRO-3, or say loudly that they are not.

Symptom
    A LoRA (any peft) adapter trained under DeepSpeed ZeRO-3 is saved without
    its weights, and nothing fails until the adapter is loaded or used:

    * HF Trainer (transformers < 5.0), ``stage3_gather_16bit_weights_on_model_save``
      false (DeepSpeed's default): ``trainer.save_model()`` (and every
      checkpoint ``save_strategy`` writes) leaves ``adapter_model.safetensors``
      with no tensors at all; the same run under ZeRO-2 saves every tensor.
      Reports: trl #4416, peft #2892, DeepSpeed #7900.
    * HF Trainer (transformers >= 5.0, either gather setting), the vocabulary
      resized before LoRA (new special tokens) with the embeddings frozen
      (likewise embeddings targeted by LoRA, and a second, inactive adapter):
      peft says "Setting `save_embedding_layers` to `True` as the embedding
      layer has been resized during finetuning" and writes the LoRA tensors
      only; the embeddings it means to save are left out of the file (ZeRO-2
      writes them).  Loading the adapter on a freshly resized base gives the
      new tokens other embeddings than training had.  Found here, not found
      reported; ms-swift's ``_fix_zero3_gather_all_parameters`` (transformers
      < 5) does the same.
    * HF Trainer (transformers < 5.0) with ``stage3_gather_16bit_weights_on_model_save``:
      right files, but every save gathers the whole model, frozen base
      included, into the saving rank's host memory to write the adapter's
      few tensors (what ms-swift's ``_fix_zero3_gather_all_parameters`` and
      transformers 5 avoid; at 70B that is 140 GB of bf16 per save).
    * A custom loop around ``deepspeed.initialize``: ``model.save_pretrained(dir)``
      or ``get_peft_model_state_dict(model)`` returns and writes every
      partitioned adapter tensor as a ``torch.Size([0])`` placeholder, on
      every rank and on rank 0 alone.  peft 0.21 adds a ``PeftWarning``
      ("LoRA tensor(s) have invalid shape ... shards were not gathered") and
      still writes them.  Reports: accelerate #3508, peft #2500, #2450
      (``modules_to_save``), OpenRLHF #651.

Cause
    Under ZeRO-3 each parameter's ``data`` is an empty placeholder; its shard
    is in ``ds_tensor`` and the whole tensor exists only inside a gather that
    every rank joins.  transformers' ``Trainer.save_model`` asks accelerate for
    the 16-bit consolidated state dict; with the 16-bit gather off that raises
    ``ValueError``, and transformers falls back to ``_save(state_dict={})``
    ("stage3_gather_16bit_weights_on_model_save=false. Saving the full
    checkpoint instead") and then removes the empty ``model.safetensors`` /
    ``pytorch_model.bin`` it wrote, but not the empty
    ``adapter_model.safetensors`` a ``PeftModel`` writes from that dictionary.
    peft never gathers: ``get_peft_model_state_dict`` reads
    ``model.state_dict()``, i.e. the placeholders.  LoRA tensors smaller than
    ``stage3_param_persistence_threshold`` (default 1e5 elements) are not
    partitioned and are saved whole; HF Trainer's ``"auto"`` threshold is
    10 x hidden size.

Affected versions
    Trainer: every transformers with any DeepSpeed and peft.  Read from the
    released wheels: 4.49.0 and 4.57.6 have the ``_save(state_dict={})``
    fallback for every model, and with the 16-bit gather take accelerate's
    whole-model ``get_state_dict``; 5.0.0 (and 5.23.0) gather the trainable
    parameters of a peft model under ZeRO-3 themselves
    (``_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)``,
    huggingface/transformers #41416), and nothing frozen, whatever peft
    would write (the target's source tells the two apart).  Run: 4.49.0,
    4.57.6, 5.23.0 (peft 0.14.0, 0.17.1, 0.21.2).  Custom loops: every peft release (0.14.0,
    0.17.1, 0.18.1, 0.20.0, 0.21.0, 0.21.2 read: none gathers; 0.21.0 added a
    PeftWarning and still writes the placeholders).

Flag
    ``ZEROSHIM_ZERO3_PEFT_SAVE=auto|on|off`` (default ``auto``).

Fix
    * ``Trainer.save_model``, where DeepSpeed runs ZeRO-3 and the model is a
      peft model (not with AutoTP or AutoEP, where DeepSpeed's own gather
      does more): every rank asks peft what ``save_pretrained`` will write
      (``get_peft_model_state_dict`` on ``state_dict(keep_vars=True)``, for
      every adapter: the trainable tensors, the embeddings where peft saves
      them -- vocabulary resized, or embeddings targeted -- and an inactive
      adapter's; where peft computes on what it saves -- prompt learning,
      AdaLoRA's rank pattern, VB-LoRA's top-k -- every trainable tensor and
      both embeddings instead).  The ranks check in the process group's
      key-value store that they chose the same tensors (no collective; a
      rank that waited ``RENDEZVOUS_TIMEOUT_S`` for the others logs a WARNING
      and every rank leaves the save to transformers), then every rank
      gathers exactly those (one module at a time,
      ``GatheredParameters(..., modifier_rank=None)``, between the
      optimizer's checkpoint prologue and epilogue, as DeepSpeed's own gather
      runs), kept where transformers writes the files (``should_save``).
      That dictionary is what transformers saves: it replaces the ``{}`` of
      transformers < 5 without the 16-bit gather, and otherwise the engine's
      ``_zero3_consolidated_16bit_state_dict`` returns it for the length of
      the call (instead of gathering the whole model, < 5 with the 16-bit
      gather, or the trainable tensors only, >= 5; an instance attribute
      set there before, as ms-swift sets its own, is put back after).  On
      transformers >= 5 it acts only where peft writes a frozen parameter
      and said so itself; otherwise transformers' own save writes the same
      file.  Everything else transformers does (its warning, the DeepSpeed
      checkpoint it also writes) is unchanged.  Trainer calls ``save_model``
      on every rank, so the gather is safe there.  Tested: fp32 LoRA on
      q/v, its files equal a whole-model gather's, bit for bit.
    * ``get_peft_model_state_dict`` (which ``PeftModel.save_pretrained`` calls
      on every rank it runs on): when it would return ZeRO-3 placeholders (it
      is probed with ``state_dict(keep_vars=True)``, no collective), the ranks
      first meet in the process group's key-value store (no collective, so a
      rank alone cannot hang in it).  If every rank of the job arrives within
      ``RENDEZVOUS_TIMEOUT_S`` (60 s) with the same parameters to gather, the
      call runs inside ``GatheredParameters(those parameters,
      modifier_rank=None)`` and returns full tensors (copies).  A caller's own
      ``state_dict=`` is never touched; nothing changes where the tensors are
      whole (ZeRO-1/2, persistent parameters, inside the caller's own gather).
    * A rank saving alone (``if rank == 0: model.save_pretrained(...)``): a
      gather on one rank would hang, so peft's own result is returned and
      written (the placeholders, as without zeroshim) once the rank stops
      waiting: at once where it sees another rank wait in a
      ``torch.distributed.barrier()`` it has not reached itself (that rank
      cannot come to the save first; seen for ``BARRIER_SETTLE_S``, 1 s, so
      a lone save takes about 1.5 s), otherwise after
      ``RENDEZVOUS_TIMEOUT_S``.  To know this, every blocking barrier on the
      default process group adds one to a count in the store as a rank
      enters it and one as it leaves (two store additions a barrier, about
      0.1-0.3 ms; rank 0 deletes the previous barrier's keys; the keys name
      the torchrun run and restart, whose store outlives restarted workers;
      where ``barrier`` is not the function zeroshim knows, or the store
      fails, nothing is counted and the whole wait applies).  Then, with a
      WARNING on that rank naming the cause and the remedies; and
      ``PeftModel.save_pretrained`` notes the directory, whose adapter file is
      read again when the process exits (``check_lone_saves``, shapes only):
      still placeholders -> an ERROR naming the file and the remedy; whole
      tensors -> INFO (the program wrote its own over peft's file, as OpenRLHF
      0.11.2 ``DeepspeedStrategy.save_model`` does, ``utils/deepspeed/
      deepspeed.py`` lines 552-581: it gathers on every rank, calls
      ``save_pretrained`` on rank 0 alone, then replaces the file with
      ``adapter_model.bin``).  Such a program's files are the same with and
      without zeroshim; its save takes about 1.5 s longer (its other ranks
      wait in a barrier; up to zeroshim 0.2.x, ``RENDEZVOUS_TIMEOUT_S``).
      A lone ``save_pretrained`` without ``state_dict`` on a rank other than
      global rank 0 skips its write instead (WARNING): its file could only
      hold placeholders, and written after rank 0's it replaces the whole one.
      That happens where every rank believes it is the main process: axolotl
      0.19 / HF Trainer on a CPU-only accelerate 1.13 (no backend, so every
      rank has ``process_index`` 0 and ``should_save``), where plain runs left
      a placeholder file 6 times in 10 (``nox -s "clients(framework='axolotl')"``).
      (Up to zeroshim 0.2.0 the lone call raised ``RuntimeError`` instead,
      which made OpenRLHF's working save fail.)
    One WARNING per job the first time a save is changed.

Undo
    ``zeroshim.unpatch("zero3_peft_save")`` restores the methods.
"""

from __future__ import annotations

import logging
import os

from zeroshim import _dist, _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, TargetChanged, guard, require, require_attr, require_params

NAME = "zero3_peft_save"
#: seconds a rank saving a partitioned adapter waits for the other ranks before saving alone
RENDEZVOUS_TIMEOUT_S = 60.0
#: what the patch did (introspection and tests): Trainer saves whose adapter was gathered,
#: get_peft_model_state_dict calls gathered, calls made on a rank alone (peft's placeholders returned),
#: lone save_pretrained writes skipped on ranks other than 0
stats = {"trainer_gathered": 0, "trainer_dropped": 0, "trainer_full": 0, "trainer_frozen": 0,
         "gathered": 0, "alone": 0, "skipped": 0}
_where: dict = {}
_lone_calls: list = []   # per lone call: the keys it returned as placeholders
_lone_dirs: list = []    # (directory, keys) where a lone save_pretrained wrote them, checked at exit
_saving: list = []       # non-empty while PeftModel.save_pretrained runs (zeroshim's wrapper)
_pending: dict = {}   # id(trainer) -> (case, the gathered state dict, tensors, frozen), while its save_model runs


def _acted(what: str) -> None:
    _log.acted(NAME, "%s", "without it the adapter file would hold no tensors or [0]-shaped ZeRO-3 placeholders",
               what)


# -- HF Trainer ---------------------------------------------------------------------------
def _trainer_engine(trainer):
    """The ZeRO-3 engine whose peft model ``Trainer.save_model`` is about to save, or None."""
    if not getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        return None
    if getattr(getattr(trainer, "accelerator", None), "parallelism_config", None) is not None:
        return None  # transformers saves through accelerate's N-D parallel branch instead
    if (getattr(trainer.model, "_tp_size", 0) or 0) > 1:
        return None
    engine = getattr(trainer, "model_wrapped", None)
    partitioned = getattr(engine, "zero_optimization_partition_weights", None)
    if partitioned is None or getattr(engine, "zero_gather_16bit_weights_on_model_save", None) is None:
        return None
    if not partitioned() or not _where["is_peft_model"](trainer.model):
        return None
    if (getattr(engine, "autotp_size", lambda: 1)() or 1) > 1:
        return None  # DeepSpeed gathers tensor-parallel shards too: its own gather
    try:
        getattr(engine, "_raise_if_autoep_zero3_consolidated_export", lambda op: None)("save_model")
    except Exception:  # AutoEP: DeepSpeed refuses to consolidate, and says why
        return None
    return engine


def peft_selection(model) -> "tuple[dict, bool]":
    """What ``PeftModel.save_pretrained`` writes of ``model``'s state dict, for every adapter, as peft
    itself selects it: ``({state_dict key: tensor}, certain)``, found by calling ``get_peft_model_state_dict``
    on ``state_dict(keep_vars=True)`` (the parameters themselves; no collective).  The trainable tensors,
    and the embedding layers where peft saves them too (``save_embedding_layers="auto"``: vocabulary
    resized since the base checkpoint, or embeddings targeted), and an inactive adapter's.  Not certain
    (``certain`` False) where peft computes on the tensors it saves: a prompt-learning adapter (its
    embedding is computed by a forward), a tuner that returns tensors that are not the model's own
    (AdaLoRA's rank pattern, VB-LoRA's top-k) or fails on the ZeRO-3 placeholders; then every trainable
    tensor and every parameter of the input and output embeddings, a superset."""
    import warnings

    from peft.utils import save_and_load

    full = model.state_dict(keep_vars=True)
    keys_of: dict = {}
    for key, value in full.items():
        keys_of.setdefault(id(value), []).append(key)
    chosen: set = set()
    configs = getattr(model, "peft_config", None) or {}
    certain = bool(configs) and not any(getattr(c, "is_prompt_learning", False) for c in configs.values())
    if certain:
        with warnings.catch_warnings():  # peft's notes ("Setting save_embedding_layers...") are said at the save
            warnings.simplefilter("ignore")
            for adapter in list(configs):
                try:
                    returned = save_and_load.get_peft_model_state_dict(model, state_dict=full, adapter_name=adapter)
                except Exception:  # a tuner that computes on what it saves, here on placeholders of shape [0]
                    certain = False
                    break
                for value in returned.values():
                    if id(value) in keys_of:
                        chosen.update(keys_of[id(value)])
                    else:
                        certain = False
    if not certain:
        extra = [p for p in full.values() if getattr(p, "requires_grad", False)]
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            try:
                layer = getattr(model, getter)()
            except Exception:  # not a transformers model, or no such layer
                layer = None
            extra.extend(layer.parameters() if layer is not None else ())
        for value in extra:
            chosen.update(keys_of.get(id(value), ()))
    return {key: full[key] for key in full if key in chosen}, certain


def _modules(module):
    return module.named_modules(remove_duplicate=False)


def _gather_selected(engine, selected: dict, keep: bool) -> dict:
    """``selected``'s tensors, whole, on CPU, keyed as in ``module.state_dict()``: its parameters gathered
    one module at a time on every rank (``GatheredParameters(..., modifier_rank=None)``), kept where ``keep``
    (a parameter shared by two keys stays one tensor, as in a state dict).  Around it, what DeepSpeed's own
    ``_zero3_consolidated_16bit_state_dict`` runs around its gather: the optimizer's checkpoint prologue (every
    parameter partitioned) and epilogue (the persistent ones gathered again)."""
    import contextlib

    import deepspeed

    module = engine.module
    optimizer = getattr(engine, "optimizer", None)
    has = getattr(engine, "_optimizer_has_ckpt_event_prologue", None)
    if has is not None and has():
        optimizer.checkpoint_event_prologue()
    try:
        out = _gather_each(module, selected, keep)
    finally:
        has = getattr(engine, "_optimizer_has_ckpt_event_epilogue", None)
        if has is not None and has():
            optimizer.checkpoint_event_epilogue()
    missing = sorted(set(selected) - set(out)) if keep else []
    if missing:  # a key that is no module path + parameter name (a state-dict hook): never save without it
        raise RuntimeError(f"zeroshim[{NAME}]: could not gather {len(missing)} of the tensors peft saves "
                           f"({', '.join(missing[:5])}); set ZEROSHIM_ZERO3_PEFT_SAVE=off")
    return out


def _gather_each(module, selected: dict, keep: bool) -> dict:
    import contextlib

    import deepspeed

    want = {id(t) for t in selected.values()}
    out, copies = {}, {}
    for prefix, mod in _modules(module):
        prefix = prefix + "." if prefix else ""
        params = [(n, p) for n, p in mod.named_parameters(recurse=False) if p is not None and id(p) in want]
        buffers = [(n, b) for n, b in mod.named_buffers(recurse=False) if b is not None and id(b) in want]
        if not params and not buffers:
            continue
        gather = (deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None) if params
                  else contextlib.nullcontext())
        with gather:
            if keep:
                for n, t in params + buffers:
                    if prefix + n in selected:
                        if id(t) not in copies:
                            copies[id(t)] = t.detach().cpu().clone()
                        out[prefix + n] = copies[id(t)]
    return out


def _frozen(selected: dict) -> int:
    """How many of ``selected``'s tensors are parameters that do not train (buffers are not counted)."""
    import torch

    return sum(isinstance(t, torch.nn.Parameter) and not t.requires_grad for t in set(selected.values()))


def _trainer_plan(trainer):
    """``(case, selected, frozen)`` where zeroshim gathers what a Trainer's peft save writes (``frozen``: how
    many of those are parameters that do not train), else None.  Cases:
    ``"dropped"`` (transformers < 5 without the 16-bit gather: it would write no tensors), ``"full"``
    (transformers < 5 with it: it would gather the whole model, frozen base included, onto the saving rank),
    ``"frozen"`` (transformers >= 5: it gathers the trainable tensors only, and peft would write frozen
    ones too -- resized embeddings -- which it would silently leave out)."""
    engine = _trainer_engine(trainer)
    if engine is None:
        return None
    selected, certain = peft_selection(engine.module)
    if not selected:
        return None
    frozen = _frozen(selected)
    if _where.get("trainer_kind") == "gathers":
        if not certain or not frozen:
            return None  # transformers' own save writes the same tensors (it keeps every persistent buffer)
        return "frozen", selected, frozen
    return ("full" if engine.zero_gather_16bit_weights_on_model_save() else "dropped"), selected, frozen


_WHY = {
    "dropped": "without it Trainer.save_model (transformers < 5, no stage3_gather_16bit_weights_on_model_save) "
               "writes an adapter file with no tensors",
    "full": "Trainer.save_model (transformers < 5, stage3_gather_16bit_weights_on_model_save) would gather "
            "the whole model, frozen base included, into the saving rank's host memory to write the adapter's "
            "tensors (transformers 5 gathers only the trainable ones, #41416)",
    "frozen": "Trainer.save_model (transformers >= 5) gathers only the trainable tensors under ZeRO-3, so the "
              "frozen ones peft saves as well -- the embeddings of a resized vocabulary -- would be left out of "
              "the adapter file silently",
}


class _Shadow:
    """For one ``save_model`` call: the engine's ``_zero3_consolidated_16bit_state_dict`` returns the
    dictionary zeroshim gathered (None on ranks that do not save), without gathering again; whatever the
    instance held under that name before (ms-swift sets its own) is put back after."""
    NAME = "_zero3_consolidated_16bit_state_dict"

    def __init__(self, engines, result):
        self.engines, self.result, self.before = engines, result, []

    def __enter__(self):
        def consolidated(*args, **kwargs):
            return self.result

        for engine in self.engines:
            self.before.append(engine.__dict__.get(self.NAME, _Shadow))
            engine.__dict__[self.NAME] = consolidated
        return self

    def __exit__(self, *exc):
        for engine, before in zip(self.engines, self.before):
            if before is _Shadow:
                engine.__dict__.pop(self.NAME, None)
            else:
                engine.__dict__[self.NAME] = before
        return False


def _save_model(wrapped, instance, args, kwargs):
    """Wraps ``Trainer.save_model`` (run on every rank)."""
    import contextlib

    gathered, shadow = None, contextlib.nullcontext()
    with guard(NAME):
        plan = _trainer_plan(instance) if is_active(NAME) else None
        if plan is not None:
            case, selected, frozen = plan
            params = [t for t in selected.values() if hasattr(t, "ds_id")]
            # every rank must gather the same parameters (peft may ask the Hub for the base config)
            why = _rendezvous(params, "trainer")
            if why is not None:
                _log.warning("zeroshim[%s]: Trainer.save_model of a peft model under ZeRO-3: the ranks did not "
                             "select the same tensors to save (%s), so zeroshim leaves this save to "
                             "transformers (%s).", NAME, why, _WHY[case], scope=_log.EVERY)
            else:
                keep = bool(instance.args.should_save)  # where transformers writes the files
                engine = instance.model_wrapped
                gathered = _gather_selected(engine, selected, keep)
                _pending[id(instance)] = (case, gathered, len(selected), frozen)
                if case != "dropped":
                    engines = [engine] + [e for e in (getattr(instance, "deepspeed", None),)
                                          if e is not None and e is not engine]
                    shadow = _Shadow(engines, gathered if keep else None)
    if gathered is None:
        return wrapped(*args, **kwargs)
    try:
        with shadow:
            return wrapped(*args, **kwargs)
    finally:
        _pending.pop(id(instance), None)


def _save(wrapped, instance, args, kwargs):
    """Wraps ``Trainer._save(output_dir=None, state_dict=None)``: saves zeroshim's dictionary."""
    with guard(NAME):
        pending = _pending.get(id(instance))
        state_dict = args[1] if len(args) > 1 else kwargs.get("state_dict")
        if pending is not None:
            case, gathered, count, frozen = pending
            if case == "dropped" and isinstance(state_dict, dict) and not state_dict:
                if len(args) > 1:
                    args = (args[0], gathered) + tuple(args[2:])
                else:
                    kwargs = dict(kwargs, state_dict=gathered)
                state_dict = gathered
            if state_dict is gathered:
                stats["trainer_gathered"] += 1
                stats["trainer_" + case] += 1
                _log.acted(NAME, "Trainer.save_model of a peft model under ZeRO-3: gathered on every rank only "
                           "the %d tensors peft writes (%d of them frozen) and saved them", "%s", count, frozen,
                           _WHY[case])
    return wrapped(*args, **kwargs)


def patch_trainer(module, patcher: Patcher) -> None:
    from zeroshim import _source

    cls = require_attr(module, "Trainer")
    save_model = require_attr(cls, "save_model")
    source = _source.source_text(save_model)
    if source is None:  # no source shipped: the version decides, never "target changed"
        from zeroshim import _versions

        gathers = _versions.in_range(_versions.installed("transformers") or "0", ">=5.0")
    else:
        gathers = "exclude_frozen_parameters=True" in source
        require("_zero3_consolidated_16bit_state_dict" in source or "get_state_dict(self.deepspeed)" in source,
                "Trainer.save_model takes no ZeRO-3 consolidated state dict")
        if not gathers:
            require("state_dict={}" in source, "Trainer.save_model has no _save(output_dir, state_dict={}) fallback")
    require_params(require_attr(cls, "_save"), "output_dir", "state_dict")
    _where["is_peft_model"] = getattr(module, "_is_peft_model", None) or _is_peft_model
    # transformers >= 5.0 (#41416) gathers a peft model's trainable tensors itself, < 5 all or nothing
    _where["trainer_kind"] = "gathers" if gathers else "fallback"
    patcher.wrap(cls, "save_model", _save_model)
    patcher.wrap(cls, "_save", _save)
    _where["trainer"] = ("Trainer.save_model and Trainer._save wrapped (transformers gathers the trainable "
                         "tensors itself)" if gathers else "Trainer.save_model and Trainer._save wrapped")


def _is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


# -- peft: get_peft_model_state_dict ----------------------------------------------------
def _placeholders(wrapped, args, kwargs):
    """The ZeRO-3 parameters (not gathered now) whose placeholders ``get_peft_model_state_dict``
    would return, found by calling it on ``state_dict(keep_vars=True)`` (no collective); [] if none.  Where
    that call fails on the placeholders (a tuner that computes on what it saves), the superset of
    :func:`peft_selection`."""
    import inspect
    import warnings

    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    model = bound.arguments.get("model")
    if bound.arguments.get("state_dict") is not None or model is None:
        return []  # the caller's own state dict is theirs
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return []
    bound.arguments["state_dict"] = model.state_dict(keep_vars=True)  # the Parameters themselves
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = wrapped(*bound.args, **bound.kwargs).values()
    except Exception:
        # a tuner that computes on what it saves (AdaLoRA's rank pattern, VB-LoRA's top-k) fails on placeholders
        # of shape [0]: gather what peft_selection takes where it cannot be certain (every trainable tensor and
        # both embeddings, a superset), and peft then computes on the real tensors
        values = peft_selection(model)[0].values()
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    plan, seen = [], set()
    for value in values:
        if getattr(value, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE and id(value) not in seen:
            seen.add(id(value))
            plan.append(value)
    return plan


def _rendezvous(plan, kind: str = "peft") -> "str | None":
    """Meet the other ranks in the default store; None when all arrived with the same ``plan``, else why not.
    ``kind`` keeps the Trainer's meetings and peft's apart (their own sequence numbers and keys: a Trainer save
    and a lone ``save_pretrained`` may carry the same parameters)."""
    import zlib

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return "torch.distributed is not initialised"
    world = dist.get_world_size()
    if world == 1:
        return None
    try:
        store = _dist.default_store(dist)
    except Exception as exc:  # no store to meet in (e.g. an MPI process group)
        return f"no key-value store to meet the other ranks in ({exc})"
    signature = zlib.crc32(repr([(p.ds_id, tuple(p.ds_shape)) for p in plan]).encode())
    seq = _where.setdefault("seq/" + kind, 0)
    key = f"zeroshim/{NAME}/{_run()}/{kind}/{seq}/{signature:08x}"
    if store.add(key, 1) >= world:
        store.set(key + "/all", "1")
    else:
        why = _wait_for_all(store, key + "/all", dist.get_rank(), world)
        # withdraw, so that a later save on every rank still meets; where the count was full when this
        # rank withdrew, the last rank arrived as it gave up, and the others go ahead: so does this one
        if why is not None and store.add(key, -1) < world - 1:
            return why
    _where["seq/" + kind] += 1
    return None


def _run() -> str:
    """This run of the job, for the store's keys: torchrun keeps its store across the restarts of its workers
    (``--max-restarts``), and a restarted worker counts from 0 again, so keys left by an earlier attempt must not
    be read as this one's."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '-')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _wait_for_all(store, key: str, rank: int, world: int) -> "str | None":
    """Wait until ``key`` is set (every rank arrived: None), or say why this rank stops waiting: another rank
    is seen waiting, for ``BARRIER_SETTLE_S`` on end, in a barrier this rank has not reached (it cannot come to
    this save before this rank reaches that barrier), or ``RENDEZVOUS_TIMEOUT_S`` passed.  Polls with
    ``store.check`` (no blocking wait: a zero timeout means "forever" to c10d, and each timed-out wait logs)."""
    import time

    start = time.monotonic()
    pause, blocked_since = 0.005, None
    while True:
        try:
            if store.check([key]):
                return None
        except Exception as exc:  # the store itself failed: nobody can meet in it
            return f"the process group's store failed ({type(exc).__name__}: {exc})"
        now = time.monotonic()
        if now - start >= RENDEZVOUS_TIMEOUT_S:
            return (f"rank {rank} waited {RENDEZVOUS_TIMEOUT_S:g} s, and not every one of the {world} ranks called "
                    "it with the same parameters")
        if not _peer_in_barrier(store):
            blocked_since = None
        elif blocked_since is None:
            blocked_since = now
        elif now - blocked_since >= BARRIER_SETTLE_S:
            return (f"another rank waits in torch.distributed.barrier() (barrier {_barriers['entered'] + 1} of the "
                    f"job), which rank {rank} has not reached, so it cannot join this save first")
        time.sleep(min(pause, max(0.0, start + RENDEZVOUS_TIMEOUT_S - now)))
        pause = min(pause * 2, POLL_S)


# -- torch.distributed.barrier: which rank waits in which barrier --------------------------------------------
#: a rank saving alone polls whether the others arrived or wait in a barrier, at most POLL_S seconds apart
POLL_S = 0.5
#: how long another rank must be seen inside a barrier this rank has not reached before this rank saves alone
#: (a barrier that has just completed counts as entered and not left until its rank writes that it left)
BARRIER_SETTLE_S = 1.0
#: barriers on the default process group this process entered through torch.distributed.barrier; "off": why
#: counting stopped (the store failed once), after which this rank never decides from the counts
_barriers: dict = {"entered": 0, "off": None}


def _barrier_key(number: int) -> str:
    return f"zeroshim/{NAME}/{_run()}/barrier/{number}"


def _peer_in_barrier(store) -> bool:
    """Whether some rank is now inside the barrier this rank would enter next (entered, not left): it waits
    there for this rank.  Each rank counts the blocking barriers on the default group it enters; all ranks call
    them in the same order, so a rank's n-th is every rank's n-th."""
    if _barriers["off"]:
        return False
    key = _barrier_key(_barriers["entered"] + 1)
    try:
        entered = store.add(key + "/in", 0)  # read before "out": a rank that leaves in between reads as left
        return entered > store.add(key + "/out", 0)
    except Exception:
        return False


def _barrier(wrapped, instance, args, kwargs):
    """Wraps ``torch.distributed.barrier(group=None, async_op=False, device_ids=None, ...)``: a blocking barrier
    on the default process group adds one to the store's count of ranks inside it before, and one to those that
    left it after it returns (two store additions a barrier; global rank 0 also deletes the previous barrier's two
    keys, which every rank left before it entered this one).  A failing store, or a barrier that raises, only
    stops the counting on this rank; the barrier's own result or error is the user's."""
    key = None
    if is_active(NAME) and not _barriers["off"]:
        try:
            key = _barrier_enter(args, kwargs)
        except Exception as exc:  # never the reason a barrier fails: stop counting on this rank
            _barriers["off"] = f"{type(exc).__name__}: {exc}"
            _log.log.debug("zeroshim[%s]: stopped counting barriers (%s)", NAME, _barriers["off"])
    if key is None:
        return wrapped(*args, **kwargs)
    store, number, rank = key
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:  # the user's error, at once (no store call that could wait on a lost store host)
        _barriers["off"] = "a barrier raised"
        raise
    try:
        store.add(_barrier_key(number) + "/out", 1)
    except Exception as exc:
        _barriers["off"] = f"{type(exc).__name__}: {exc}"
        return result
    try:
        if number > 1 and rank == 0:  # every rank left barrier n-1 before it entered barrier n
            for end in ("/in", "/out"):
                store.delete_key(_barrier_key(number - 1) + end)
    except Exception:  # a store without delete_key: the keys stay (two small keys a barrier)
        pass
    return result


def _barrier_enter(args, kwargs):
    """``(store, the barrier's number, this rank)`` after counting this rank into a blocking barrier on the default
    group; None for any other call (asynchronous, another group, no process group of several ranks)."""
    group = args[0] if args else kwargs.get("group")
    async_op = args[1] if len(args) > 1 else kwargs.get("async_op", False)
    if async_op:
        return None
    found = _dist.group()
    if found is None:
        return None
    dist, _, rank = found
    if group is not None and group is not dist.distributed_c10d._get_default_group():
        return None
    number = _barriers["entered"] + 1
    store = _dist.default_store(dist)
    store.add(_barrier_key(number) + "/in", 1)
    _barriers["entered"] = number
    return store, number, rank


def patch_barrier(module, patcher: Patcher) -> None:
    """Counts the barriers (``_barrier``) where ``barrier`` is the function it knows; elsewhere counts nothing,
    and a rank saving alone then waits ``RENDEZVOUS_TIMEOUT_S`` as before: the counting only shortens a wait,
    so a changed ``barrier`` never skips the patch (a skip here would take the saves' fix with it)."""
    import inspect

    try:
        func = require_attr(module, "barrier")
        params = list(inspect.signature(func, follow_wrapped=True).parameters)
        require(params[:2] == ["group", "async_op"], f"it takes ({', '.join(params)}), not (group, async_op, ...)")
        require_attr(module, "_get_default_group")
    except (TargetChanged, TypeError, ValueError) as exc:
        _barriers["off"] = f"torch.distributed.barrier is not counted: {exc}"
        _log.log.debug("zeroshim[%s]: %s; a rank saving alone waits %g s", NAME, _barriers["off"],
                       RENDEZVOUS_TIMEOUT_S)
        return
    patcher.wrap(module, "barrier", _barrier, rebind_aliases=True)


def _alone_warning(plan, why: str) -> str:
    return (f"zeroshim[{NAME}]: a peft adapter is being saved under DeepSpeed ZeRO-3 with {len(plan)} tensor(s) "
            f"that are partition placeholders of shape [0] here, and zeroshim cannot gather them: gathering needs "
            f"every rank, but {why}.  peft's own file is written (placeholders, no weights); zeroshim checks it "
            "again when this process exits and logs an ERROR if it still holds placeholders then.  A program that "
            "writes the gathered tensors over it afterwards (OpenRLHF does) needs nothing.  Otherwise call "
            "model.save_pretrained(dir, is_main_process=(rank == 0)) (or get_peft_model_state_dict) on every rank, "
            "and zeroshim gathers the tensors; or gather them yourself on every rank with "
            "deepspeed.zero.GatheredParameters(params, modifier_rank=None); or set "
            "stage3_gather_16bit_weights_on_model_save: true and use engine.save_16bit_model().")


ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def _placeholder_count(path: str) -> int:
    """How many tensors of the adapter file at ``path`` hold no elements (shapes only for safetensors)."""
    import math

    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            return sum(math.prod(handle.get_slice(key).get_shape()) == 0 for key in handle.keys())
    import torch

    tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return sum(isinstance(v, torch.Tensor) and v.numel() == 0 for v in tensors.values())


def check_lone_saves() -> list:
    """Check the adapter files written by saves that zeroshim could not gather (a rank saving alone):
    one verdict per directory, ``"placeholders"`` (logged at ERROR: the adapter holds no weights),
    ``"replaced"`` (the program wrote whole tensors over peft's file) or ``"gone"`` (no adapter file
    left there to check).  Run at process exit; each directory is checked once."""
    verdicts = []
    while _lone_dirs:
        directory, keys = _lone_dirs.pop(0)
        present = [os.path.join(directory, f) for f in ADAPTER_FILES if os.path.exists(os.path.join(directory, f))]
        try:
            empty = {path: _placeholder_count(path) for path in present}
        except Exception as exc:  # unreadable file: say so, never raise at exit
            _log.warning("zeroshim[%s]: could not read the adapter saved alone in %s to check it (%s: %s)", NAME,
                         directory, type(exc).__name__, exc, scope=_log.EVERY)
            verdicts.append({"directory": directory, "verdict": "unreadable"})
            continue
        bad = {path: n for path, n in empty.items() if n}
        if bad:
            verdict = "placeholders"
            _log.emit(logging.ERROR, _log.EVERY,
                      "zeroshim[%s]: the peft adapter saved on one rank alone in %s still holds %s ZeRO-3 placeholder "
                      "tensor(s) of shape [0] when checked (at process exit): it has no trained weights and will not load as trained.  "
                      "Save it on every rank (model.save_pretrained(dir, is_main_process=(rank == 0))), and zeroshim "
                      "gathers the tensors; or gather them yourself with deepspeed.zero.GatheredParameters(params, "
                      "modifier_rank=None) on every rank.", NAME, directory,
                      ", ".join(f"{n} ({os.path.basename(p)})" for p, n in bad.items()))
        elif present:
            verdict = "replaced"
            _log.info("zeroshim[%s]: the adapter saved alone in %s now holds whole tensors (%s): the program wrote "
                      "its own over peft's placeholders", NAME, directory,
                      ", ".join(os.path.basename(p) for p in present), scope=_log.EVERY)
        else:
            verdict = "gone"
            _log.info("zeroshim[%s]: no adapter file is left in %s, where one was saved alone; nothing to check",
                      NAME, directory, scope=_log.EVERY)
        verdicts.append({"directory": directory, "verdict": verdict, "keys": len(keys),
                         "files": {os.path.basename(p): n for p, n in empty.items()}})
    return verdicts


class _SkipWrite(Exception):
    """Raised inside ``PeftModel.save_pretrained`` to skip a lone placeholder write on a rank other than 0."""


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _get_peft_model_state_dict(wrapped, instance, args, kwargs):
    """Wraps ``peft.utils.save_and_load.get_peft_model_state_dict(model, state_dict=None, adapter_name=...)``."""
    plan = None
    with guard(NAME):
        if is_active(NAME):
            plan = _placeholders(wrapped, args, kwargs)
    if not plan:
        return wrapped(*args, **kwargs)
    why = "?"
    gather = None
    with guard(NAME):
        why = _rendezvous(plan)
        if why is None:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(plan, modifier_rank=None)
    if why is not None:  # a rank alone: peft's own result, said loudly, and its file checked at exit
        result = wrapped(*args, **kwargs)
        skip = False
        with guard(NAME):
            stats["alone"] += 1
            _lone_calls.append([k for k, v in result.items() if getattr(v, "numel", lambda: 1)() == 0])
            rank = _global_rank()
            skip = bool(_saving) and rank != 0
            if skip:
                stats["skipped"] += 1
                _log.warning("zeroshim[%s]: rank %d called save_pretrained alone under DeepSpeed ZeRO-3 with %d "
                             "partition placeholder(s) of shape [0] and no state_dict (%s): its file could only "
                             "hold placeholders, and written after rank 0's it would replace that one, so this "
                             "rank's write is skipped (rank 0 writes the job's files).  Seen where every rank "
                             "believes it is the main process (HF Trainer on a CPU-only accelerate).  "
                             "ZEROSHIM_ZERO3_PEFT_SAVE=off writes it as peft does.", NAME, rank, len(plan), why,
                             scope=_log.EVERY, once=(NAME, "skipped"))
            else:
                _log.warning("%s", _alone_warning(plan, why), scope=_log.EVERY, once=(NAME, "alone"))
        if skip:
            raise _SkipWrite()
        return result
    if gather is None:  # zeroshim's own error (logged by guard): peft's behaviour
        return wrapped(*args, **kwargs)
    import torch

    with gather:
        result = wrapped(*args, **kwargs)
        result = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in result.items()}
    stats["gathered"] += 1
    _acted(f"get_peft_model_state_dict/save_pretrained under ZeRO-3: gathered {len(plan)} partitioned adapter "
           "tensor(s) on every rank so that they are saved whole")
    return result


def _save_pretrained(wrapped, instance, args, kwargs):
    """Wraps ``PeftModel.save_pretrained(save_directory, ...)``: notes where a lone save wrote placeholders."""
    import time

    before = len(_lone_calls)
    started = time.time()
    _saving.append(True)
    try:
        result = wrapped(*args, **kwargs)
    except _SkipWrite:
        return None
    finally:
        _saving.pop()
    with guard(NAME):
        if len(_lone_calls) > before:
            keys = [k for call in _lone_calls[before:] for k in call]
            directory = args[0] if args else kwargs.get("save_directory")
            directory = os.fspath(directory)
            found = set()
            for root in [] if not os.path.isdir(directory) else [directory] + [os.path.join(directory, d) for d in sorted(os.listdir(directory))
                                      if os.path.isdir(os.path.join(directory, d))]:
                for name in ADAPTER_FILES:
                    path = os.path.join(root, name)
                    if os.path.exists(path) and os.path.getmtime(path) >= started - 2:
                        found.add(root)
            for root in sorted(found):
                _lone_dirs.append((root, keys))
            if found and not _where.get("atexit"):
                import atexit

                atexit.register(check_lone_saves)
                _where["atexit"] = True
    return result


def patch_save_and_load(module, patcher: Patcher) -> None:
    func = require_attr(module, "get_peft_model_state_dict")
    require_params(func, "model", "state_dict", "adapter_name")
    patcher.wrap(module, "get_peft_model_state_dict", _get_peft_model_state_dict, rebind_aliases=True)


def patch_peft_model(module, patcher: Patcher) -> None:
    cls = require_attr(module, "PeftModel")
    require_params(require_attr(cls, "save_pretrained"), "save_directory")
    patcher.wrap(cls, "save_pretrained", _save_pretrained)


def check_config(cfg, affected: bool) -> list:
    """``zeroshim doctor --config``: ZeRO-3 without the 16-bit gather, where HF Trainer of this
    transformers saves peft adapters empty."""
    gather = cfg.zero.get("stage3_gather_16bit_weights_on_model_save", False)
    if not affected or cfg.stage != 3 or gather is True or str(gather).lower() == "true":
        return []
    from zeroshim import _versions

    transformers = _versions.installed("transformers")
    if transformers is None or _versions.base_version(transformers) >= _versions.base_version("5.0.0"):
        return []
    return [{"level": "warning",
             "message": "ZeRO-3 without stage3_gather_16bit_weights_on_model_save: HF Trainer of transformers "
                        f"{transformers} (< 5.0) saves a peft adapter with no tensors (adapter_model.safetensors "
                        "empty; nothing fails).  (A full model is saved as a DeepSpeed checkpoint only, with a "
                        "warning; zeroshim leaves that as it is.)"}]


def _reset() -> None:
    _pending.clear()
    _lone_calls.clear()
    _saving.clear()


PATCH = Patch(
    changes=('numbers', 'memory', 'collectives'),
    on_disagreement="stop",  # without it the adapter is saved without its weights, silently
    name=NAME,
    summary="peft adapter saved under ZeRO-3 without its weights: HF Trainer (transformers < 5) writes an empty "
            "adapter_model.safetensors, (>= 5) leaves out the embeddings of a resized vocabulary, "
            "save_pretrained/get_peft_model_state_dict write [0]-shaped placeholders",
    signatures=(
        (r"LoRA tensor\(s\) have invalid shape: .*:\(0,\)", r"DeepSpeed ZeRO-3 / FSDP shards\s+were not gathered"),
        (r"stage3_gather_16bit_weights_on_model_save=false\. Saving the full checkpoint instead",
         r"adapter_model\.safetensors|adapter_config\.json|trainable params: "),
    ),
    versions_note=("with ZeRO-3; HF Trainer: transformers < 5.0.0, and >= 5.0.0 with a resized vocabulary; "
                   "custom loops, save_pretrained and get_peft_model_state_dict: every peft, 0.21 only warns"),
    affects={"peft": "", "deepspeed": ""},
    targets={"peft.utils.save_and_load": patch_save_and_load, "peft.peft_model": patch_peft_model,
             "transformers.trainer": patch_trainer, "torch.distributed.distributed_c10d": patch_barrier},
    optional=("transformers.trainer", "peft.peft_model", "torch.distributed.distributed_c10d"),
    on_undo=_reset,
    check_config=check_config,
)
