"""Divide the loss by ``gradient_accumulation_steps`` once in ``engine.backward`` (DeepSpeed 0.18.3-0.19.5).

Symptom
    Nothing fails.  With ``gradient_accumulation_steps`` above 1, ``engine.backward(loss)`` trains with gradients
    that are not the loss's divided by the accumulation steps:

    * a forward that returns the loss together with tensors it was computed from -- a ``dict``, tuple or list
      holding ``loss`` and ``logits``, as every Hugging Face model's ``ModelOutput`` does -- gets gradients divided
      once more per such tensor on the loss's path: ``gradient_accumulation_steps`` times too small with ``loss`` and
      ``logits`` (4 times at 4 micro-batches), more with hidden states.  ZeRO stages 0, 1 and 2; ZeRO-3 replaces the
      outputs with tensors off the loss's path and is not hit by this part.  Hit: raw DeepSpeed loops and
      accelerate loops (``accelerator.backward(outputs.loss)`` calls ``engine.backward`` with the default
      ``scale_wrt_gas=True``), the HF Trainer before 4.49 (it calls the same); the HF Trainer from 4.49 on passes
      ``scale_wrt_gas=False`` and divides the loss itself, which DeepSpeed honours from 0.18.4.  The reported
      gradient norm is as much too small, the learning rate of SGD-like optimizers as much too small, and gradient
      clipping as much too loose; Adam's update is nearly scale-free, so runs train, to other numbers;
    * a loss with parts that do not come from the engine's forward (``engine(x)`` plus a term computed with
      ``engine.module`` directly, a regulariser over the parameters) gets those parts' gradients not divided at all
      (DeepSpeed #8224), on every stage;
    * 0.18.3 only: ``scale_wrt_gas=False`` is ignored, so the HF Trainer from 4.49 on, which divides the loss
      itself, gets its gradients divided twice.

Cause
    DeepSpeed 0.18.3 (#7665, "PyTorch-compatible backward API") moved the division by the accumulation steps from
    the loss into a hook that ``engine.forward`` registers on every tensor of its output with a ``grad_fn``
    (``register_output_backward_hooks(..., preprocess_per_tensor_fn=self._backward_prologue_per_tensor)``), so that
    ``output.backward()`` called directly is scaled too.  Each such tensor divides the gradient that reaches it, so
    the division happens once per hooked tensor on a path and never on a path that bypasses them.  0.19.6 (#8245,
    for #8224) divides the loss once in ``engine.backward`` and marks its backward so the output hooks leave it.

Affected versions
    DeepSpeed >= 0.18.3, < 0.19.6, read from the sdists of 0.18.2-0.18.6, 0.19.0-0.19.6 and 0.19.8: ``backward``
    computes only its return value as ``loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss`` (the
    source fingerprint) while the output hooks divide; 0.18.2 divides the loss (``_scale_loss_by_gas``) and has no
    output hooks; 0.19.6 divides the loss and registers the backward graph (``_ENGINE_BACKWARD_GRAPH_TRACKER``).
    0.18.3's hook divides whatever ``scale_wrt_gas`` says; 0.18.4 reads it.  Reproduced on CPU, 2 ranks, fp32,
    ZeRO-2, 4 micro-batches: with a ``{"loss", "logits"}`` output the reported gradient norm is 0.103 on 0.18.5
    against 0.412 on 0.18.2 and 0.19.8 (which agree bit for bit).

    Not changed, because 0.19.6 and later keep it too: ``output.backward()`` called directly (not through
    ``engine.backward``) is divided at each hooked output, so a ``{"loss", "logits"}`` output is divided twice there
    on every release from 0.18.3, 0.19.8 included.  Pipeline engines are left as DeepSpeed has them: their stages
    before the last divided the gradient again on 0.18.3-0.19.2, fixed in 0.19.3 (#8154, which gives
    ``PipelineEngine`` its own ``_backward_prologue_per_tensor``); not examined further.  So are engines that run
    backward under compiled autograd (``engine.compile(compiled_autograd_enabled=True)``), which traces the hooks.

Flag
    ``ZEROSHIM_GAS_OUTPUT_SCALING=auto|on|off`` (default ``auto``).

Fix
    ``DeepSpeedEngine.backward`` is wrapped: with ``gradient_accumulation_steps`` above 1 it registers, for the
    call, a hook on the loss that divides the loss's gradient by the accumulation steps (where ``scale_wrt_gas`` is
    true) -- the same division of the same value as 0.19.6's ``loss / gradient_accumulation_steps()`` -- and marks
    the engine and the backward pass's autograd graph task, so that
    ``DeepSpeedEngine._backward_prologue_per_tensor``, also wrapped, passes the gradients of the output hooks
    through unchanged during that call -- this engine's, and another engine's whose outputs are in the same loss, as
    0.19.6's graph tracker does. DeepSpeed's own code runs as it is, with the loss it was given: its return value,
    its loss scaling and the other patches that look at the loss are unchanged. Where the forward returned the loss
    alone the gradients are those of the unpatched run bit for bit; where it returned more, or the loss has parts
    from elsewhere, they are 0.19.6's. A forward that returned a tensor the loss was computed from outside (``loss =
    f(engine(x))``) has the division at the loss instead of that tensor: the same bits where the accumulation steps
    are a power of two, possibly the last bit otherwise. It changes the numbers of the runs it fixes: said once per
    job at WARNING. Ranks that disagree stop.

Undo
    ``zeroshim.unpatch("gas_output_scaling")`` restores ``backward`` and ``_backward_prologue_per_tensor``.

Evidence
    benchmarks/RESULTS.md, ``gas_output_scaling``.
"""

from __future__ import annotations

import weakref

from zeroshim import _log, _versions
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr, require_params
from zeroshim._source import Fingerprint

NAME = "gas_output_scaling"
#: scaled: engine.backward calls whose loss was divided once (accumulation steps above 1, scale_wrt_gas true);
#: unscaled: calls with scale_wrt_gas false whose output hooks were kept from dividing
stats = {"scaled": 0, "unscaled": 0}
_inside: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> depth of engine.backward calls
_tasks: dict = {}  # autograd graph task id -> count, for the backward passes a patched engine.backward runs
_base: list = []  # DeepSpeedEngine, once patched


def _own_scaling(engine) -> bool:
    """A pipeline engine (it scales by stage, #8154) or a subclass with its own per-tensor scaling: left to it."""
    for cls in type(engine).__mro__:
        if _base and cls is _base[0]:
            return False
        if cls.__module__.startswith("deepspeed.runtime.pipe") or "_backward_prologue_per_tensor" in vars(cls):
            return True
    return True


def _task() -> int:
    """The running autograd graph task's id (-1 outside one, or where torch lacks the call)."""
    import torch

    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1


def _plan(engine, args, kwargs):
    """(loss, divide) where this backward is to be scaled once at the loss; else None."""
    if not is_active(NAME) or _own_scaling(engine) or getattr(engine, "_is_compiled_autograd_enabled", False):
        return None  # compiled autograd traces the hooks: left to DeepSpeed
    import torch

    loss = args[0] if args else kwargs.get("loss")
    scale = args[2] if len(args) > 2 else kwargs.get("scale_wrt_gas", True)
    steps = engine.gradient_accumulation_steps()
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or not isinstance(steps, int) or steps <= 1:
        return None
    return loss, steps if scale else None


def _say(engine, divided: bool) -> None:
    if divided:
        _log.acted(NAME, "divided the loss by gradient_accumulation_steps once in engine.backward, as DeepSpeed 0.19.6 "
                         "does", "DeepSpeed %s divides the gradient at every tensor the forward returned instead: "
                   "twice or more where the output holds the loss and the logits it came from (a ModelOutput, a "
                   "dict), not at all for loss parts computed outside the engine's forward",
                   _versions.shown("deepspeed"))
    elif not hasattr(engine, "_scale_wrt_gas"):  # 0.18.3: its output hooks divide whatever scale_wrt_gas says
        _log.acted(NAME, "kept engine.backward(loss, scale_wrt_gas=False) from dividing the gradients by "
                         "gradient_accumulation_steps, as DeepSpeed 0.18.4 does", "DeepSpeed %s divides them at the "
                   "forward's outputs all the same, so a loss the caller divided itself (the HF Trainer from 4.49 "
                   "on) is divided twice", _versions.shown("deepspeed"))


def _loss_hook(steps, seen: list):
    """The hook on the loss: notes the graph task (every engine's output hooks in it pass through, as 0.19.6's
    tracker does) and divides once where asked."""

    def hook(grad):
        with guard(NAME):
            task = _task()
            if task != -1 and task not in seen:
                seen.append(task)
                _tasks[task] = _tasks.get(task, 0) + 1
        return grad / steps if steps is not None else grad

    return hook


def _release(counts, key) -> None:
    """One fewer of ``key`` in ``counts`` (``_inside``, ``_tasks``); gone at none."""
    left = counts.get(key, 1) - 1
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)


def _backward(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine.backward(loss, retain_graph=False, scale_wrt_gas=True)``."""
    plan, handle, seen = None, None, []
    with guard(NAME):
        plan = _plan(instance, args, kwargs)
        if plan is not None:
            loss, steps = plan
            handle = loss.register_hook(_loss_hook(steps, seen))
            _inside[instance] = _inside.get(instance, 0) + 1
    if plan is None:
        return wrapped(*args, **kwargs)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        with guard(NAME):
            if handle is not None:
                handle.remove()
            for task in seen:
                _release(_tasks, task)
            _release(_inside, instance)
    with guard(NAME):
        stats["scaled" if plan[1] is not None else "unscaled"] += 1
        _say(instance, plan[1] is not None)
    return result


def _per_tensor(wrapped, instance, args, kwargs):
    """Wraps ``DeepSpeedEngine._backward_prologue_per_tensor(grad)``: unchanged inside a patched engine.backward
    (this engine's, or any engine's whose backward pass this is)."""
    passing = False
    with guard(NAME):
        passing = instance in _inside or (bool(_tasks) and _task() in _tasks)
    if passing:
        return args[0] if args else kwargs.get("grad")
    return wrapped(*args, **kwargs)


def patch_engine(module, patcher: Patcher) -> None:
    engine = require_attr(module, "DeepSpeedEngine")
    require_params(require_attr(engine, "backward"), "loss", "retain_graph", "scale_wrt_gas")
    require_params(require_attr(engine, "_backward_prologue_per_tensor"), "grad")
    require_attr(engine, "gradient_accumulation_steps")
    patcher.wrap(engine, "backward", _backward)
    patcher.wrap(engine, "_backward_prologue_per_tensor", _per_tensor)
    _base[:] = [engine]


def _reset() -> None:
    _inside.clear()
    _tasks.clear()
    _base.clear()


PATCH = Patch(
    changes=("numbers",),
    on_disagreement="stop",  # without it a rank's gradients are divided otherwise than the others'
    name=NAME,
    summary="gradient accumulation: engine.backward divides at each forward output instead of the loss, so a "
            "ModelOutput/dict output gets gradients divided by the accumulation steps twice, and loss parts from "
            "outside the engine's forward not at all (silent)",
    signatures=(),
    affects={"deepspeed": ">=0.18.3,<0.19.6"},
    fingerprint=Fingerprint("deepspeed.runtime.engine",
                            r"gas_scaled_loss = loss / self\.gradient_accumulation_steps\(\) if scale_wrt_gas "
                            r"else loss",
                            "engine.backward dividing only its return value by the accumulation steps (the output "
                            "hooks divide the gradients)"),
    targets={"deepspeed.runtime.engine": patch_engine},
    on_undo=_reset,
)
