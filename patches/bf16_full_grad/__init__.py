"""Read and write BF16_Optimizer's fp32 gradients with ``safe_get_full_grad`` and ``safe_set_full_grad``.

Symptom
    Nothing fails.  With DeepSpeed's ``BF16_Optimizer`` (``bf16`` with ZeRO stage 1 and
    ``"data_types": {"grad_accum_dtype": "fp32"}``; bf16 without ZeRO on DeepSpeed <= 0.17.5; bf16 pipeline
    parallelism):

    * ``deepspeed.utils.safe_get_full_grad(param)`` returns this rank's bf16 gradient of the last micro-batch
      alone, not the gradient the optimizer steps with: the fp32 sum over the accumulation, averaged over the
      ranks.  Measured on DeepSpeed 0.19.2, 2 ranks, gradient accumulation 2: 0.4 to 0.8 of the true gradient,
      another value on each rank.  Gradient-norm logging, gradient surgery and regularisers built on it read
      wrong numbers.
    * ``safe_set_full_grad(param, value)`` and ``safe_update_full_grad_vectorized`` write that bf16 staging
      gradient, which the step never reads: the step uses the gradient the user meant to replace.  Zeroing every
      gradient this way still moves every weight.

    ZeRO-1/2/3's own optimizers are not affected.

Cause
    ``deepspeed/utils/tensor_fragment.py`` returns (or writes) ``param.grad`` whenever it is not None.  Under ZeRO's
    optimizers it is None after the backward; ``BF16_Optimizer`` keeps it, as the staging area it adds into its
    fp32 buffer after each backward (``_update_hp_grad``, which also sets ``param._hp_grad`` to the parameter's
    view of that buffer).  Its fallback, ``param.get_full_hp_grad()``, would not help either: it indexes
    ``BF16_Optimizer``'s per-parameter gradient list by the parameter's index among its own partition's
    parameters, and copies the whole gradient on every rank that holds a piece of it before summing over the
    ranks.  DeepSpeed 0.19.8 reads ``param._hp_grad`` first and mends both; writing is unchanged there.

Affected versions
    Read from the released sdists (``deepspeed/utils/tensor_fragment.py``): reading, every release with
    ``safe_get_full_grad`` (0.8.2) before 0.19.8; writing, every release with ``safe_set_full_grad`` and
    ``safe_update_full_grad_vectorized`` (0.15.3, DeepSpeed #6590), 0.19.8 included.  Either function's
    ``param.grad`` branch is the source fingerprint.  0.17.6-0.18.4 never build ``BF16_Optimizer`` (their
    ``BFLOAT16`` and ``DDP_BFLOAT16`` are the same string, and the engine tests the second first: see patch
    ``bf16_zero1_last_microbatch``), so nothing acts there.

Flag
    ``ZEROSHIM_BF16_FULL_GRAD=auto|on|off`` (default ``auto``).

Fix
    ``BF16_Optimizer._link_all_hp_params`` (run when it is built, and at a checkpoint load) is wrapped to mark its
    parameters as its own (a weak reference; ``destroy()`` takes the mark away).  The three functions are wrapped
    (``deepspeed.utils``'s names too; reading only where the release reads ``param.grad`` first).  Where the
    original would return or write ``param.grad`` (it is not None) of a parameter of a live ``BF16_Optimizer``:

    * reading returns a float32 copy of the optimizer's fp32 gradient of it, the parameter's shape.  At the end of
      an accumulation (after the backward that all-reduces, before ``step()``, where DeepSpeed documents the call)
      it is what the step uses and what 0.19.8 returns, bit for bit.  Between micro-batches it is this rank's sum
      so far (0.19.8 returns each rank's own piece of it there, stitched together);
    * writing copies the value into ``param.grad``, as the original does, then into that fp32 gradient, so the
      step uses it.  ``update_func`` gets the fp32 gradient, as under ZeRO's optimizers; what it raises or
      returns is the user's, as with the original.

    Everything else goes to the original.  Where the original takes ``param.grad`` it runs no collective, so no
    collective is added or removed, and the ranks decide as the original does (``param.grad`` being None or not).
    It changes the numbers such calls read, and the numbers of a run that writes gradients: said once per job at
    WARNING.

Undo
    ``zeroshim.unpatch("bf16_full_grad")`` restores the three functions, the names ``deepspeed.utils`` holds, and
    ``BF16_Optimizer``'s two methods (the marks left on parameters are read by nothing else).

Evidence
    benchmarks/RESULTS.md, ``bf16_full_grad``.
"""

from __future__ import annotations

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import NotAffected, Patcher, guard, require_attr
from zeroshim._source import Fingerprint, reaches

NAME = "bf16_full_grad"
MODULE = "deepspeed.utils.tensor_fragment"
#: ``safe_get_full_grad`` returning ``param.grad`` before anything else (< 0.19.8 reads the ``_hp_grad`` first)
READS_STAGING = r'"""\s*\n    if param\.grad is not None:\n        return param\.grad\n'
#: ``safe_set_full_grad`` / ``safe_update_full_grad_vectorized`` writing ``param.grad`` where it is not None
WRITES_STAGING = r"if (p|param)\.grad is not None:\n\s+(p|param)\.grad\.copy_\("
#: read: full gradients returned from BF16_Optimizer's fp32 buffer; written: gradients written into it (per parameter)
stats = {"read": 0, "written": 0}


#: set on each parameter of a live BF16_Optimizer: (weak reference to it, group index, index in the group)
OWNER = "_zeroshim_bf16_owner"


def _hp(param):
    """The fp32 accumulation of ``param``'s gradient in the live ``BF16_Optimizer`` that holds it (whole on every
    rank), where the original reads or writes ``param.grad`` (it is not None); else None, and the original runs,
    its own collectives included.  The same decision on every rank wherever the original's is the same."""
    entry = getattr(param, OWNER, None)
    if entry is None or getattr(param, "grad", None) is None:
        return None
    optimizer = entry[0]()
    if optimizer is None:
        return None
    hp = optimizer.fp32_groups_gradients[entry[1]][entry[2]]
    return hp if hp.numel() == param.numel() else None


def _full(param, hp):
    import torch

    return hp.detach().to(torch.float32, copy=True).view(param.shape)


def _write(param, hp, value) -> None:
    """As the original, into ``param.grad``, then into the fp32 gradient (broadcast as ``copy_`` does).  Its errors
    are those the original raises for such a value (outside any guard)."""
    param.grad.copy_(value)
    hp.view(param.shape).copy_(value)


def _said_read() -> None:
    stats["read"] += 1
    _log.acted(NAME, "safe_get_full_grad returned BF16_Optimizer's fp32 gradient (summed over the accumulation and "
                     "averaged over the ranks: what the step uses), as DeepSpeed 0.19.8 does",
               "DeepSpeed %s returns this rank's bf16 gradient of the last micro-batch alone",
               _versions.shown("deepspeed"))


def _said_written(what: str, count: int = 1) -> None:
    stats["written"] += count
    _log.warning("zeroshim[%s]: %s wrote BF16_Optimizer's fp32 gradient, which the optimizer step uses, because "
                 "DeepSpeed %s writes only the bf16 copy, which the step never reads. This changes the run's numbers: "
                 "the step uses the gradients you set. %s=off turns this off.", NAME, what,
                 _versions.shown("deepspeed"), "ZEROSHIM_" + NAME.upper(), scope=_log.RANK0, once=(NAME, "written"))


def _param(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def _get(wrapped, instance, args, kwargs):
    """Wraps ``safe_get_full_grad(param)``."""
    with guard(NAME):
        param = _param(args, kwargs, 0, "param")
        hp = _hp(param) if is_active(NAME) else None
        if hp is not None:
            value = _full(param, hp)
            _said_read()
            return value
    return wrapped(*args, **kwargs)


def _set(wrapped, instance, args, kwargs):
    """Wraps ``safe_set_full_grad(param, value)``."""
    hp = None
    with guard(NAME):
        param, value = _param(args, kwargs, 0, "param"), _param(args, kwargs, 1, "value")
        hp = _hp(param) if is_active(NAME) else None
    if hp is None:
        return wrapped(*args, **kwargs)
    _write(param, hp, value)
    with guard(NAME):
        _said_written("safe_set_full_grad")
    return None


def _update(wrapped, instance, args, kwargs):
    """Wraps ``safe_update_full_grad_vectorized(param_list, update_func)``: ``BF16_Optimizer``'s parameters here,
    first, the others by the original, after (as the original, which also takes the parameters with
    ``param.grad`` first)."""
    params = list(_param(args, kwargs, 0, "param_list"))  # read once: a generator is passed on as this list
    update_func = _param(args, kwargs, 1, "update_func")
    mine, rest = [], []
    with guard(NAME):
        if is_active(NAME):
            for p in params:
                hp = _hp(p)
                if hp is None:
                    rest.append(p)
                else:
                    mine.append((p, hp))
    if not mine:
        return wrapped(params, update_func)
    for p, hp in mine:  # the user's function and what it returns: outside any guard, their errors are the user's
        _write(p, hp, update_func(_full(p, hp), p))
    with guard(NAME):
        _said_written("safe_update_full_grad_vectorized", len(mine))
    if rest:
        return wrapped(rest, update_func)
    return None


def _linked(wrapped, instance, args, kwargs):
    """Wraps ``BF16_Optimizer._link_all_hp_params()`` (at its construction, and again at a checkpoint load): marks
    its parameters as its own."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        import weakref

        owner = weakref.ref(instance)
        for i, group in enumerate(getattr(instance, "bf16_groups", ())):
            for j, param in enumerate(group):
                setattr(param, OWNER, (owner, i, j))
    return result


def _destroy(wrapped, instance, args, kwargs):
    """Wraps ``BF16_Optimizer.destroy()``: its parameters are no longer its own."""
    with guard(NAME):
        for group in getattr(instance, "bf16_groups", ()):
            for param in group:
                entry = getattr(param, OWNER, None)
                if entry is not None and entry[0]() is instance:
                    delattr(param, OWNER)
    return wrapped(*args, **kwargs)


def patch_bf16_optimizer(module, patcher: Patcher) -> None:
    cls = require_attr(module, "BF16_Optimizer")
    require_attr(cls, "_link_all_hp_params")
    patcher.wrap(cls, "_link_all_hp_params", _linked)
    if callable(getattr(cls, "destroy", None)):  # (0.14.x has none: a collected optimizer's weak reference dies)
        patcher.wrap(cls, "destroy", _destroy)


def _uses_staging(func, pattern: str) -> bool:
    """The function reads or writes ``param.grad`` first; where its source cannot be read, assumed (the wrapper
    then returns or writes what 0.19.8 would at the end of an accumulation: never a patch turned off unseen)."""
    return reaches(func, pattern, depth=0)[0] is not False


def patch_tensor_fragment(module, patcher: Patcher) -> None:
    wrapped = 0
    get = getattr(module, "safe_get_full_grad", None)
    if get is not None and _uses_staging(get, READS_STAGING):
        patcher.wrap(module, "safe_get_full_grad", _get, rebind_aliases=True)
        wrapped += 1
    # (no require_params: an argument not found by position or its name reaches the original unchanged)
    for attr, wrapper in (("safe_set_full_grad", _set), ("safe_update_full_grad_vectorized", _update)):
        func = getattr(module, attr, None)
        if func is not None and _uses_staging(func, WRITES_STAGING):
            patcher.wrap(module, attr, wrapper, rebind_aliases=True)
            wrapped += 1
    if not wrapped:
        raise NotAffected("safe_get_full_grad, safe_set_full_grad and safe_update_full_grad_vectorized do not use "
                          "param.grad before BF16_Optimizer's fp32 gradient (or do not exist)")


PATCH = Patch(
    changes=("numbers",),
    on_disagreement="stop",  # a rank left unpatched would step with the gradients its user's code did not set
    name=NAME,
    summary="BF16_Optimizer (bf16 ZeRO-1 with fp32 gradient accumulation): safe_get_full_grad returns the rank's "
            "last bf16 micro-batch gradient, safe_set_full_grad writes a gradient the step never reads (silent)",
    signatures=(),
    affects={"deepspeed": ""},
    versions_note="reading: before 0.19.8; writing: from 0.15.3, 0.19.8 included",
    fingerprint=Fingerprint(MODULE, READS_STAGING + "|" + WRITES_STAGING,
                            "safe_get_full_grad / safe_set_full_grad using param.grad before BF16_Optimizer's fp32 "
                            "gradient"),
    targets={MODULE: patch_tensor_fragment, "deepspeed.runtime.bf16_optimizer": patch_bf16_optimizer},
)
