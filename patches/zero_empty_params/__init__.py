"""Let ZeRO-1 and ZeRO-2 train a model with zero-sized trainable parameters, as DeepSpeed 0.19.6 does.

Symptom
    A trainable parameter with no elements (``nn.Linear(d, 0)``, a register or prompt table of length 0, an
    ``nn.Parameter(torch.empty(0))`` kept for a checkpoint's layout) fails ZeRO stage 1 and 2, in every precision:

    * where it is the last of its param group, the first backward fails with ``KeyError: <n>`` at
      ``partition_ids = self.param_to_partition_ids[i][param_id]`` (DeepSpeed #8279);
    * where it lies strictly inside a rank's partition, ``deepspeed.initialize`` fails with ``AssertionError:
      fragment start 8 should be < fragment_end 8`` (DeepSpeed #8297);
    * where it lies at the start of a rank's partition, training runs, but ``safe_get_full_grad`` and
      ``safe_set_full_grad`` address the parameter after it by the wrong index: a size error
      (``RuntimeError: The size of tensor a (16) must match the size of tensor b (0)``), or, where the neighbours
      have the same size, another parameter's gradient read or overwritten.

    ZeRO stage 0 and torch DDP train such a model.  ZeRO-3 fails too, on every release read through 0.19.8
    (another cause, not covered here).

Cause
    ``reduce_independent_p_g_buckets_and_remove_grads`` puts every parameter into the reduction bucket, and the
    reduction looks each one up among the partitions; a parameter of size 0 at the end of a group starts where no
    partition does, so it is in none.  ``mixed_precision_linkage._init_lp_to_hp_mapping`` takes a parameter into
    a partition where ``current_offset < partition_end and lp_param_end > partition_start``: a zero-sized one
    strictly inside is taken and given an empty fragment (which ``get_hp_fragment_mapping`` refuses), one at a
    partition's start is left out of the indices that ``get_partition_info`` counts.  Where the gradients are
    checked for overflow (fp16; bf16 with ``check_grad_overflow``, the default from 0.19.3), the check takes
    ``.max()`` of each gradient of the partition, which fails on an empty one (``RuntimeError: max(): Expected
    reduction dim to be specified for input.numel() == 0``).  ``BF16_Optimizer`` (bf16
    with fp32 gradient accumulation) links its partition by the same function, so it fails the same way at
    ``initialize``.  DeepSpeed 0.19.6 (#8280 and
    the linkage fix for #8297) skips zero-sized parameters in the reduction, gives every parameter of the partition
    its index by ``get_partition_info``'s rule and links no fragment for an empty one.

Affected versions
    DeepSpeed < 0.19.6, read from the released sdists: the linkage test above (the source fingerprint) and the
    unguarded reduction are in 0.12.3, 0.14.1, 0.16.9, 0.18.5 and 0.19.5; 0.19.6 has both fixes.  Reproduced on
    CPU (gloo, 2 ranks) on 0.18.5 and 0.19.2; 0.19.8 trains every case.

Flag
    ``ZEROSHIM_ZERO_EMPTY_PARAMS=auto|on|off`` (default ``auto``).

Fix
    Wrappers, as 0.19.6.  ``DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads`` returns
    at once for a zero-sized parameter (it has nothing to reduce; no collective is added or removed), and
    ``_has_inf_or_nan`` finds no inf or NaN in an empty gradient, as 0.19.6's ``has_inf_or_nan``.  After
    ``_init_lp_to_hp_mapping`` returns, where its parameter list holds a zero-sized parameter, zero-sized
    parameters are dropped from the fragments to link and, under ``DeepSpeedZeroOptimizer`` (whose gradient lists
    follow the partition), every parameter's ``_index_in_param_group`` is set by the partition rule.
    ``BF16_Optimizer``'s indices are left as DeepSpeed sets them: its gradient list holds every parameter of the
    group, which no partition index matches before 0.19.8 (``safe_get_full_grad`` reads ``param.grad`` there
    while it is set).  A model without zero-sized parameters is left as it is: its mapping is the same by
    construction.  What it changes: the errors above go, and under ZeRO-1/2's optimizer
    ``safe_get_full_grad``/``safe_set_full_grad`` address the right parameter; the training of a run that trained
    is the same (said once per job at INFO).

Undo
    ``zeroshim.unpatch("zero_empty_params")`` restores the four functions.

Evidence
    benchmarks/RESULTS.md, ``zero_empty_params``.
"""

from __future__ import annotations

import threading

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "zero_empty_params"
#: skipped: zero-sized parameters left out of a gradient reduction; relinked: partition mappings whose indices
#: were set by the partition rule (a zero-sized parameter in the group)
stats = {"skipped": 0, "relinked": 0}


def _said(what: str) -> None:
    _log.acted(NAME, "%s, as DeepSpeed 0.19.6 does", "DeepSpeed %s fails on (or misaddresses) a trainable parameter "
               "with no elements under ZeRO-1/2", what, _versions.shown("deepspeed"))


def _skips_empty() -> bool:
    """For a zero-sized parameter: is it left out of the reduction (the patch on; then counted, said once)?"""
    with guard(NAME):
        if is_active(NAME):
            stats["skipped"] += 1
            _said("left zero-sized parameters out of the gradient reduction")
            return True
    return False


def _reduce(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads(param, i)`` where that
    method is not a plain function of the class (:func:`_reduce_replacement` otherwise)."""
    param = args[0] if args else kwargs.get("param")
    if not param.numel() and _skips_empty():
        return None
    return wrapped(*args, **kwargs)


def _reduce_replacement(original):
    """The same as a plain function (``Patcher.wrap_hot``): DeepSpeed calls it once per parameter per backward."""
    from zeroshim import _timing

    call = _timing.original(original)  # benchmark mode: DeepSpeed's time is not zeroshim's

    def reduce_independent_p_g_buckets_and_remove_grads(self, param, *args, **kwargs):
        if not param.numel() and _skips_empty():
            return None
        return call(self, param, *args, **kwargs)

    return reduce_independent_p_g_buckets_and_remove_grads


def _has_inf_or_nan(wrapped, instance, args, kwargs):
    """Wraps the static ``DeepSpeedZeroOptimizer._has_inf_or_nan(x, j=None)``: an empty gradient holds no inf or
    NaN (0.19.6's ``has_inf_or_nan``); DeepSpeed's ``.max()`` of an empty tensor raises."""
    x = args[0] if args else kwargs.get("x")
    if not x.numel():
        with guard(NAME):
            if is_active(NAME):
                import torch

                return torch.zeros((), dtype=torch.float, device=x.device)
    return wrapped(*args, **kwargs)


def partition_indices(params, partition_start: int, partition_size: int) -> "dict[int, int]":
    """``{position in params: index in the partition}`` for the parameters of the flat group ``params`` (laid
    out in order) that DeepSpeed's ``get_partition_info`` counts in the partition ``[partition_start,
    partition_start + partition_size)``: those that start inside it, and one that starts before it and reaches
    into it."""
    out, offset, end = {}, 0, partition_start + partition_size
    for position, param in enumerate(params):
        size = param.numel()
        if partition_start <= offset < end or offset < partition_start < offset + size:
            out[position] = len(out)
        offset += size
    return out


#: set while ``DeepSpeedZeroOptimizer._link_all_hp_params`` runs in this thread: its gradient lists follow the
#: partition (``BF16_Optimizer``'s hold every parameter of the group, so its indices are left as DeepSpeed sets them)
_zero_linking = threading.local()


def _link_all(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer._link_all_hp_params()``."""
    _zero_linking.on = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        _zero_linking.on = False


def _link(wrapped, instance, args, kwargs):
    """Wraps ``_init_lp_to_hp_mapping(lp_param_list, partition_start, partition_size, dp_group)``: its result is
    the list of ``(parameter, offset)`` to link; it sets each parameter's ``_index_in_param_group``."""
    linked = wrapped(*args, **kwargs)
    with guard(NAME):
        if not is_active(NAME):
            return linked
        bound = dict(zip(("lp_param_list", "partition_start", "partition_size", "dp_group"), args), **kwargs)
        params = list(bound["lp_param_list"])
        if not any(p.numel() == 0 for p in params):
            return linked
        fixed = [(p, offset) for p, offset in linked if p.numel() > 0]
        if getattr(_zero_linking, "on", False):
            for position, index in partition_indices(params, bound["partition_start"],
                                                     bound["partition_size"]).items():
                params[position]._index_in_param_group = index
        stats["relinked"] += 1
        _said("linked ZeRO's partitions without fragments for zero-sized parameters, and indexed them as the "
              "partition does")
        return fixed
    return linked


def patch_stage_1_and_2(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedZeroOptimizer")
    require_params(cls.reduce_independent_p_g_buckets_and_remove_grads, "param", "i")
    require_attr(cls, "_link_all_hp_params")
    patcher.wrap_hot(cls, "reduce_independent_p_g_buckets_and_remove_grads", _reduce, _reduce_replacement)
    patcher.wrap(cls, "_link_all_hp_params", _link_all)
    require_params(cls._has_inf_or_nan, "x")
    patcher.wrap(cls, "_has_inf_or_nan", _has_inf_or_nan)


def patch_linkage(module, patcher: Patcher) -> None:
    require_attr(module, "link_hp_params")
    init = require_attr(module, "_init_lp_to_hp_mapping")
    require_params(init, "lp_param_list", "partition_start", "partition_size", "dp_group")
    patcher.wrap(module, "_init_lp_to_hp_mapping", _link)


PATCH = Patch(
    changes=("error",),  # training that ran is the same; safe_get/set_full_grad address the right parameter
    name=NAME,
    summary="ZeRO-1/2 with a zero-sized trainable parameter: \"KeyError\" at the first backward or \"fragment "
            "start N should be < fragment_end N\" at initialize",
    signatures=(
        # the message, and the partition lookup of the reduction in the traceback
        (r"KeyError: \d+", r"partition_ids = self\.param_to_partition_ids\[i\]\[param_id\]"),
        r"fragment start (\d+) should be < fragment_end \1\b",
    ),
    affects={"deepspeed": "<0.19.6"},
    fingerprint=Fingerprint("deepspeed.utils.mixed_precision_linkage",
                            r"if current_offset < partition_end and lp_param_end > partition_start:",
                            "the partition test that takes a zero-sized parameter strictly inside a partition "
                            "(0.19.6 tests as get_partition_info does)"),
    targets={"deepspeed.runtime.zero.stage_1_and_2": patch_stage_1_and_2,
             "deepspeed.utils.mixed_precision_linkage": patch_linkage},
)
