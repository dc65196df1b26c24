"""Keep frozen ZeRO-3 parameters gathered through a non-reentrant checkpoint's recompute.

Symptom
    ZeRO-3, base weights frozen (LoRA / peft), non-reentrant activation
    checkpointing (transformers 5 default; ``use_reentrant=False``; zeroshim's
    ``nonreentrant_checkpoint`` patch), at the first backward::

        torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint:
        Recomputed values for the following tensors have different metadata
        than during the forward pass.
        tensor at position 12:
        saved metadata: {'shape': torch.Size([3584]), ...}
        recomputed metadata: {'shape': torch.Size([0]), ...}

    (OpenBMB MiniCPM-V LoRA fine-tuning; the shapes are the frozen weights of
    the checkpointed decoder layer.)  Trainable parameters are not affected,
    so full fine-tuning works and only adapter training fails.

Cause
    During backward, torch re-runs the checkpointed forward and then compares
    every tensor saved by the re-run with what the first forward saved.  A
    tensor that requires grad is saved as a detached alias (it keeps the
    gathered storage); a frozen parameter is saved as the parameter object
    itself.  DeepSpeed's forward hooks run in the re-run too, and the post-
    forward hook releases each submodule's parameters right after its forward:
    by the time torch compares, the frozen parameters' ``.data`` is the empty
    ZeRO-3 placeholder again, shape ``[0]``.

Affected versions
    DeepSpeed < 0.19.3.  Upstream fixed it in 0.19.3 (deepspeedai/DeepSpeed#8148,
    "Z3: Support for activation ckpt with frozen params"): frozen parameters
    fetched by a forward that runs inside backward are attributed to the
    submodule currently in backward and released after that submodule's
    backward.  The fix's mark, ``ds_recompute_parameters`` (the per-module set
    of attributed parameters, in ``partitioned_param_coordinator.py``), is the
    source fingerprint: absent in 0.19.2 and before, present from 0.19.3
    (diffed from the released sdists), so a build with the fix backported is
    recognised as not affected.  Reproduced here (tiny Llama + peft LoRA, CPU) on 0.14.1, 0.16.9
    and 0.19.2; the issue that asked for this patch also lists 0.17.0, 0.18.0,
    0.18.5, 0.19.0 and 0.19.1.  torch: tested on 2.13.0; the patch needs
    torch's private query of the innermost saved-tensor hook
    (``torch._C._autograd._top_saved_tensors_default_hooks``) to tell a
    checkpoint's re-run from other forwards inside backward, and is skipped,
    with that reason, on a torch without it (no fallback: upstream's broader
    rule would keep every frozen weight gathered until the end of backward).

Flag
    ``ZEROSHIM_ZERO3_FROZEN_RECOMPUTE=auto|on|off`` (default ``auto``).

Fix
    The same rule as upstream, built from wrappers around three methods of
    ``DeepSpeedZeRoOffload`` (which DeepSpeed's module hooks call by name, so
    engines built before the patch are covered too) and one of the ZeRO-3
    optimizer:

    * ``pre_sub_module_backward_function``: the submodule whose backward has
      begun is pushed on an ordered set of "backward owners";
    * ``pre_sub_module_forward_function``: when this forward is the re-run of
      a *non-reentrant* checkpoint (the innermost saved-tensor hook is torch's
      recomputation hook), each frozen parameter just fetched is marked as in
      use by the most recent owner (DeepSpeed's own ``ds_active_sub_modules``,
      so its forward release leaves it alone);
    * ``post_sub_module_backward_function``: once the owner's backward is done
      (its gradients have reached its inputs), the mark is removed and every
      parameter it kept that is not persistent is released;
    * ``backward_epilogue`` (DeepSpeed >= 0.18.3) or ``backward`` of the ZeRO-3
      optimizer: owners whose post-backward hook never fired (a checkpointed
      block fed an input that needs no grad) are released at the end of
      backward, so nothing stays gathered into the optimizer step.

    Parameters are kept no longer than upstream keeps them: from the re-run
    to the end of the innermost submodule in backward at that moment (the
    checkpointed block's frozen weights, for one block at a time).  Unlike
    upstream's rule, a *reentrant* checkpoint's re-run (which has no metadata
    check and works on these releases) is left alone: there the innermost
    owner is the model itself, and keeping every frozen weight until the end
    of backward would undo ZeRO-3 for a large LoRA model.

    Limit: a saved-tensor hook of the user's own inside the checkpointed
    function (e.g. ``torch.autograd.graph.save_on_cpu``) hides the
    recomputation hook, and the patch then does nothing for that block.

Undo
    ``zeroshim.unpatch("zero3_frozen_recompute")`` restores the four methods
    and drops the marks of a backward in flight (nothing is released then:
    DeepSpeed releases those parameters at its next reset).
"""

from __future__ import annotations

import threading
import weakref

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require, require_attr
from zeroshim._source import Fingerprint

NAME = "zero3_frozen_recompute"

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Dict, Optional, Tuple


# -- state ----------------------------------------------------------------------------
class _Owners:
    """The submodules in backward of one DeepSpeedZeRoOffload, oldest first, and
    the frozen parameters each one keeps gathered for a recompute."""

    __slots__ = ("owners", "lock")

    def __init__(self) -> None:
        #: module key -> (module, {id(param): param})
        self.owners: "Dict[int, Tuple[object, Dict[int, object]]]" = {}
        self.lock = threading.Lock()


_states: "weakref.WeakKeyDictionary[object, _Owners]" = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()

# Filled in by the apply functions from the DeepSpeed that is loaded.
_ds: dict = {}
#: counts since import (introspection and tests): parameters kept for a
#: re-run; owners (and their parameters) released at the end of backward
#: because their post-backward hook never fired
stats = {"kept": 0, "leftover_owners": 0, "leftover_params": 0}


def _state(offload, create: bool) -> "Optional[_Owners]":
    state = _states.get(offload)
    if state is None and create:
        with _states_lock:
            state = _states.setdefault(offload, _Owners())
    return state


def _key(module) -> int:
    """The id DeepSpeed records in ``param.ds_active_sub_modules`` (``ds_id``;
    ``id`` before DeepSpeed 0.15)."""
    key = getattr(module, "ds_id", None)
    return module.id if key is None else key


def _in_nonreentrant_recompute() -> bool:
    """True inside the re-run of a non-reentrant checkpoint: backward is running
    and the innermost saved-tensor hook is torch's recomputation hook."""
    import torch

    if torch._C._current_graph_task_id() == -1:
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)  # required when applying (patch_offload)
    if not hooks:
        return False
    return getattr(hooks[0], "__qualname__", "").startswith("_recomputation_hook.")


def _module_params(module):
    ppc = _ds["ppc"]
    return ppc.iter_params(module, recurse=ppc.z3_leaf_module(module))


def _coordinator(offload):
    if _ds.get("coordinator_takes_training"):
        return offload.get_param_coordinator(training=True)
    return offload.get_param_coordinator()


def _release(offload, key: int, params: "Dict[int, object]") -> None:
    """Drop ``key``'s mark from ``params``; release those no one else uses."""
    if not params:
        return
    release = getattr(_coordinator(offload), _ds["release_attr"])
    for param in params.values():
        param.ds_active_sub_modules.discard(key)
        if not getattr(param, "ds_persist", False) and not getattr(param, "is_external_param", False):
            release(param)  # a no-op while another submodule still uses it


# -- wrappers -------------------------------------------------------------------------
def _pre_backward(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeRoOffload.pre_sub_module_backward_function(sub_module)``."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        if is_active(NAME) and len(args) == 1:
            module = args[0]
            state = _state(instance, create=True)
            with state.lock:
                state.owners.setdefault(_key(module), (module, {}))
    return result


def _pre_forward(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeRoOffload.pre_sub_module_forward_function(sub_module)``."""
    result = wrapped(*args, **kwargs)
    announce = False
    with guard(NAME):
        state = _state(instance, create=False)
        if state is not None and state.owners and len(args) == 1 and _in_nonreentrant_recompute():
            with state.lock:
                if state.owners:
                    owner_key = next(reversed(state.owners))
                    kept = state.owners[owner_key][1]
                    for param in _module_params(args[0]):
                        if not param.requires_grad and id(param) not in kept:
                            param.ds_active_sub_modules.add(owner_key)
                            kept[id(param)] = param
                            stats["kept"] += 1
                            announce = True
            if announce:
                _log.info("zeroshim[%s]: keeping frozen ZeRO-3 parameters gathered through a non-reentrant "
                          "checkpoint's recompute until the checkpointed module's backward is done (DeepSpeed "
                          "0.19.3's rule; without it: CheckpointError, recomputed shape [0])", NAME,
                          once=(NAME, "announce"))
    return result


def _post_backward(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeRoOffload.post_sub_module_backward_function(sub_module)``."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        state = _state(instance, create=False)
        if state is not None and len(args) == 1:
            key = _key(args[0])
            with state.lock:
                entry = state.owners.pop(key, None)
            if entry is not None:
                _release(instance, key, entry[1])
    return result


def _drain(offload, release: bool = True) -> None:
    """Forget every owner of ``offload``; release what they kept (``release``)
    or only drop the marks."""
    state = _state(offload, create=False)
    if state is None:
        return
    with state.lock:
        entries = list(state.owners.items())
        state.owners.clear()
    for key, (_module, params) in reversed(entries):
        if release:
            _release(offload, key, params)
        else:
            for param in params.values():
                param.ds_active_sub_modules.discard(key)
    if release and entries:
        stats["leftover_owners"] += len(entries)
        stats["leftover_params"] += sum(len(params) for _key, (_module, params) in entries)


def _backward_end(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedZeroOptimizer_Stage3.backward_epilogue()`` (or ``backward``)."""
    result = wrapped(*args, **kwargs)
    with guard(NAME):
        offload = getattr(instance, "parameter_offload", None)
        if offload is not None:
            _drain(offload)
    return result


def _forget_all() -> None:
    _log.forget((NAME, "announce"))
    for offload in list(_states.keys()):
        _drain(offload, release=False)
    _states.clear()


# -- applying -------------------------------------------------------------------------
def patch_offload(module, patcher: Patcher) -> None:
    import inspect

    import deepspeed.runtime.zero.partitioned_param_coordinator as ppc
    import torch

    cls = require_attr(module, "DeepSpeedZeRoOffload")
    for attr in ("iter_params", "z3_leaf_module", "PartitionedParameterCoordinator"):
        require_attr(ppc, attr)
    release_attr = "_PartitionedParameterCoordinator__release_param"
    require_attr(ppc.PartitionedParameterCoordinator, release_attr)
    getter = require_attr(cls, "get_param_coordinator")
    require(callable(getattr(torch._C, "_current_graph_task_id", None)),
            "torch._C._current_graph_task_id does not exist")
    # Which forward inside backward is a checkpoint's re-run: the innermost saved-tensor hook is torch's
    # recomputation hook.  A torch without this query gets no fallback (upstream's rule, "any forward
    # inside backward", would keep every frozen weight gathered until the end of backward: an OOM risk
    # on a large model); the patch is skipped there, with this reason.  Tested on torch 2.13.
    require(callable(getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)),
            "torch._C._autograd._top_saved_tensors_default_hooks does not exist (this torch cannot tell a "
            "checkpoint's re-run from other forwards inside backward)")
    _ds.update(
        ppc=ppc,
        release_attr=release_attr,
        coordinator_takes_training="training" in inspect.signature(getter).parameters,
    )
    for attr, wrapper in (("pre_sub_module_backward_function", _pre_backward),
                          ("pre_sub_module_forward_function", _pre_forward),
                          ("post_sub_module_backward_function", _post_backward)):
        require_attr(cls, attr)
        patcher.wrap(cls, attr, wrapper)
    patcher.on_undo(_forget_all)


def patch_stage3(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedZeroOptimizer_Stage3")
    # DeepSpeed >= 0.18.3 ends every backward (engine.backward and a user's
    # loss.backward()) in backward_epilogue; before, the optimizer's backward.
    attr = "backward_epilogue" if hasattr(cls, "backward_epilogue") else "backward"
    require_attr(cls, attr)
    patcher.wrap(cls, attr, _backward_end)


PATCH = Patch(
    changes=('error', 'memory', 'collectives'),
    name=NAME,
    summary="ZeRO-3 + frozen weights (LoRA) + non-reentrant checkpointing: 'Recomputed values ... have "
            "different metadata' ([N] vs [0])",
    signatures=(
        # what makes it this bug: a tensor recomputed as the empty ZeRO-3 placeholder
        (r"Recomputed values for the following tensors have different metadata than during the forward pass",
         r"recomputed metadata: \{'shape': torch\.Size\(\[0\]\)"),
    ),
    affects={"deepspeed": "<0.19.3"},
    fingerprint=Fingerprint("deepspeed.runtime.zero.partitioned_param_coordinator", r"ds_recompute_parameters",
                            "the 0.19.3 fix's mark (ds_recompute_parameters, #8148)", bug_when="absent"),
    targets={
        "deepspeed.runtime.zero.parameter_offload": patch_offload,
        "deepspeed.runtime.zero.stage3": patch_stage3,
    },
)
