"""Say why ``engine.backward(loss)`` got a loss that does not require grad.

Symptom
    ``engine.backward(loss)`` fails with a message that names the wrong thing:

    * DeepSpeed 0.19.x: ``AssertionError: loss must be a scalar tensor. If you
      need to pass output gradients, backward() of output tensors``, for a
      loss that *is* a scalar tensor (``engine.py``, ``backward``:
      ``assert maybe_loss_for_backward(loss)``, which also requires a
      ``grad_fn``);
    * older releases: torch's ``RuntimeError: element 0 of tensors does not
      require grad and does not have a grad_fn`` from inside DeepSpeed's
      optimizer (``loss_scaler.backward``).

    The usual cause, found by ``nox -s differential`` (DeepSpeed 0.19.2, ZeRO-1
    and ZeRO-3, benchmarks/RESULTS.md section 9): LoRA (or any model whose only
    trainable parameters sit inside checkpointed blocks, behind a frozen
    embedding) with *reentrant* activation checkpointing (``use_reentrant=True``,
    transformers' default from 4.35 to 4.57) and block inputs that do not
    require grad.  Reentrant checkpointing then gives its blocks no gradient
    at all (torch only warns "None of the inputs have requires_grad=True"),
    so nothing in the loss requires grad.  Reports (torch's message through
    ``engine.backward``): ymcui/Chinese-LLaMA-Alpaca #547 (LoRA, ZeRO-2, with
    torch's "None of the inputs have requires_grad=True" warning just before),
    LlamaChinese/Llama-Chinese #242 (same warning, HF Trainer),
    transformers #29982 (ZeRO-3, ``stage3.py`` ``backward``),
    DeepSpeedExamples #625 and #386 (DeepSpeed-Chat ``--only_optimize_lora``
    with gradient checkpointing), locuslab/open-unlearning #28 (LoRA; points
    to DeepSpeed #3339).

Cause
    A user error, not DeepSpeed's: there is nothing to backpropagate.  But
    neither message says so, nor which of the usual reasons it is: grad
    disabled (``torch.no_grad``/``inference_mode``) around the forward, a
    detached loss, every parameter frozen, or reentrant checkpoints whose
    inputs need no grad.

Affected versions
    Every DeepSpeed release (0.14.1, 0.16.9 torch's error; 0.19.2, 0.19.8 the
    assertion; read in the installed releases, and the assertion in the
    tags' ``engine.py``).  Every such call fails: a loss that does not
    require grad cannot be backpropagated by any release.

Flag
    ``ZEROSHIM_LOSS_WITHOUT_GRAD=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine.backward`` is wrapped.  Where its loss is a tensor that
    does not require grad (the only case it looks at; a loss that requires
    grad, or anything else, goes to DeepSpeed untouched), it raises
    :class:`LossWithoutGradError` (a subclass of both ``RuntimeError`` and
    ``AssertionError``, the two types DeepSpeed raises there) before
    DeepSpeed's own check, with what it can see: how many of the model's
    parameters require grad, whether grad was enabled, and, where patch
    ``nonreentrant_checkpoint`` is active, how many reentrant checkpoint calls
    since the previous backward got no input that requires grad (that patch
    counts them and leaves them reentrant); then the remedy for each cause:
    ``model.enable_input_require_grads()`` or
    ``gradient_checkpointing_kwargs={"use_reentrant": False}``.  A run that
    trains never reaches it, so nothing changes there; no WARNING (it acts
    only where the run fails anyway).

Undo
    ``zeroshim.unpatch("loss_without_grad")`` restores ``DeepSpeedEngine.backward``.
"""

from __future__ import annotations

from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params

NAME = "loss_without_grad"
#: raised: backward calls answered with LossWithoutGradError
stats = {"raised": 0}
_seen = {"kept_no_grad_input": 0}


class LossWithoutGradError(RuntimeError, AssertionError):
    """``engine.backward(loss)`` with a loss that does not require grad (raised by zeroshim)."""


def _kept_since_last_backward() -> "int | None":
    """Reentrant checkpoint calls without an input that requires grad since the previous backward,
    as patch nonreentrant_checkpoint counts them (None where it is not active)."""
    from zeroshim._core import is_active as active

    if not active("nonreentrant_checkpoint"):
        return None
    from zeroshim.patches import nonreentrant_checkpoint

    now, before = nonreentrant_checkpoint.stats["kept_no_grad_input"], _seen["kept_no_grad_input"]
    _seen["kept_no_grad_input"] = now
    return now - before if now >= before else now  # its counters start again from 0 when it is undone


def _message(engine, loss) -> str:
    import torch

    module = getattr(engine, "module", None)
    params = list(module.parameters()) if module is not None else []
    trainable = sum(p.requires_grad for p in params)
    kept = _kept_since_last_backward()
    facts = [f"{trainable} of the model's {len(params)} parameter tensors require grad",
             f"grad mode is {'enabled' if torch.is_grad_enabled() else 'disabled'} here"]
    if kept is not None:
        facts.append(f"{kept} reentrant activation-checkpoint call(s) since the previous backward got no input that "
                     "requires grad")
    causes = []
    if kept:
        causes.append("reentrant activation checkpointing (use_reentrant=True, transformers' default from 4.35 to "
                      "4.57) around blocks whose inputs do not require grad, behind a frozen embedding (LoRA, "
                      "partly frozen models): such blocks get no gradient at all.  Call "
                      "model.enable_input_require_grads() before training (transformers/peft), or checkpoint with "
                      "use_reentrant=False (gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                      "{\"use_reentrant\": False}))")
    if not trainable:
        causes.append("no parameter requires grad: unfreeze what should train (peft: check target_modules)")
    causes.append("the forward ran under torch.no_grad() or torch.inference_mode(), or the loss was detached "
                  "(.detach(), .item(), a new tensor built from numbers)")
    if not kept:
        causes.append("reentrant activation checkpointing (use_reentrant=True) around blocks whose inputs do not "
                      "require grad (LoRA behind a frozen embedding): call model.enable_input_require_grads() or "
                      "use use_reentrant=False")
    return (f"zeroshim[{NAME}]: engine.backward(loss) got a loss that does not require grad (shape "
            f"{tuple(loss.shape)}, grad_fn None), so nothing in it can be backpropagated: {'; '.join(facts)}.  "
            "Likely causes, most likely first: " + " | ".join(f"({i}) {c}" for i, c in enumerate(causes, 1))
            + f".  (DeepSpeed itself says \"loss must be a scalar tensor\" or torch \"element 0 of tensors does "
            f"not require grad\".)  ZEROSHIM_{NAME.upper()}=off restores DeepSpeed's own error.")


def _backward(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine.backward(loss, ...)``."""
    message = None
    with guard(NAME):
        loss = args[0] if args else kwargs.get("loss")
        if is_active(NAME):
            import torch

            if isinstance(loss, torch.Tensor) and not loss.requires_grad:
                message = _message(instance, loss)
                stats["raised"] += 1
            else:
                _kept_since_last_backward()  # count from this backward on
    if message is not None:
        raise LossWithoutGradError(message)
    return wrapped(*args, **kwargs)


def patch_engine(module, patcher: Patcher) -> None:
    cls = require_attr(module, "DeepSpeedEngine")
    require_params(require_attr(cls, "backward"), "loss")
    patcher.wrap(cls, "backward", _backward)


def _reset() -> None:
    _seen["kept_no_grad_input"] = 0


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="engine.backward(loss) with a loss that needs no grad (LoRA + reentrant checkpointing without "
            "enable_input_require_grads, no_grad, detached): \"loss must be a scalar tensor\" / \"element 0 of "
            "tensors does not require grad\", without the cause",
    signatures=(r"loss must be a scalar tensor\. If you need to pass output gradients",
                (r"element 0 of tensors does not require grad and does not have a grad_fn",
                 r"deepspeed[/\\]runtime[/\\]")),
    versions_note="a clearer error only; runs that train are never touched",
    affects={"deepspeed": ""},
    targets={"deepspeed.runtime.engine": patch_engine},
    on_undo=_reset,
)
