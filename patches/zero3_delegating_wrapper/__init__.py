"""ZeRO-3 with modules that delegate attribute lookups to a child (peft ``modules_to_save``).

Symptom
    ZeRO-3 and peft with ``modules_to_save`` (for example ``["lm_head"]`` or a
    classifier head), or any wrapper module whose ``__getattr__`` forwards
    unknown names to a wrapped child, fails in the first forward::

        AttributeError: 'Linear' object has no attribute 'ds_grads_remaining'

Cause
    DeepSpeed registers its hooks children first, and gives each module its
    own backward-hook classes unless ``hasattr(module, "pre_bwd_fn")`` /
    ``hasattr(module, "post_bwd_fn")`` already says it has them.  For a
    delegating wrapper (peft's ``ModulesToSaveWrapper`` since peft 0.14) that
    ``hasattr`` finds the *child's* classes through ``__getattr__``, so the
    wrapper never gets its own; its forward hook then counts
    ``ds_grads_remaining`` on the child, whose own hook, which creates the
    counter, has not run yet.

Affected versions
    DeepSpeed >= 0.16.5, < 0.19.3, read from the released sources: #7062
    (first released in 0.16.5) moved the creation of the hook classes from the
    hooks into ``_register_deepspeed_module`` behind those ``hasattr``
    checks (0.16.4 created them inside the hooks, where the wrapper's own
    hook ran first); #8144 (first released in 0.19.3, DeepSpeed #7615) changed
    the checks to ``"pre_bwd_fn" not in module.__dict__`` (and the same for
    ``post_bwd_fn`` and ``applied_pre_backward_ref_cnt``).  No source
    fingerprint: the ``hasattr`` lines exist in 0.14.1 as well, where they are
    harmless.  Reported upstream: DeepSpeed #7615; ms-swift and axolotl carry
    their own workarounds (forwarding ``ds_*`` attributes through their
    wrappers).

Flag
    ``ZEROSHIM_ZERO3_DELEGATING_WRAPPER=auto|on|off`` (default ``auto``).

Fix
    The rule of #8144, in the same place: ``deepspeed.runtime.zero.parameter_offload``
    gets a module-level ``hasattr`` (Python looks a name up in the module's
    globals before the builtins) that answers from the module's own
    ``__dict__`` for the four per-module hook attributes (``pre_bwd_fn``,
    ``post_bwd_fn``, ``applied_pre_backward_ref_cnt``, ``ds_grads_remaining``)
    of ``torch.nn.Module`` objects, and is the builtin ``hasattr`` for
    everything else.  Must be in place when the engine registers its hooks,
    i.e. before ``deepspeed.initialize`` (an engine built earlier keeps the
    hooks it registered).

Undo
    ``zeroshim.unpatch("zero3_delegating_wrapper")`` removes the module-level name.
"""

from __future__ import annotations

import builtins

from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, require_attr

NAME = "zero3_delegating_wrapper"
OWN_ATTRIBUTES = frozenset(("pre_bwd_fn", "post_bwd_fn", "applied_pre_backward_ref_cnt", "ds_grads_remaining"))
_module_type: list = []
#: lookups answered from a module's own __dict__ that builtins.hasattr would have answered differently
stats = {"delegated_lookups_refused": 0}


def _hasattr(obj, name):
    """``hasattr`` as DeepSpeed 0.19.3 asks it for per-module hook state."""
    if name in OWN_ATTRIBUTES and _module_type and isinstance(obj, _module_type[0]) and is_active(NAME):
        own = name in vars(obj)
        if not own and builtins.hasattr(obj, name):
            stats["delegated_lookups_refused"] += 1
        return own
    return builtins.hasattr(obj, name)


def patch_parameter_offload(module, patcher: Patcher) -> None:
    import torch

    require_attr(module, "DeepSpeedZeRoOffload")
    _module_type[:] = [torch.nn.Module]
    patcher.set(module, "hasattr", _hasattr)


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="ZeRO-3 + peft modules_to_save (or any delegating wrapper module): \"'Linear' object has no attribute "
            "'ds_grads_remaining'\"",
    signatures=(r"object has no attribute 'ds_grads_remaining'",),
    affects={"deepspeed": ">=0.16.5,<0.19.3"},
    targets={"deepspeed.runtime.zero.parameter_offload": patch_parameter_offload},
)
