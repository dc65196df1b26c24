"""Scenario for patch ``accelerate_accumulation_boundary``: gradient accumulation through accelerate on a DeepSpeed
engine where a window is cut short.  The tiny MLP of ``tiny_mlp``, fp32, 2 ranks, accumulation 2, micro-batches of
2, 2 epochs.

Runs (``{path}/{tag}``):

* ``trainer/*``: the HF Trainer, ZeRO-2, 5 micro-batches per rank and epoch (windows of 2, 2 and 1: the Trainer
  counts 6 optimizer steps);
* ``accumulate/*``: a loop under ``accelerator.accumulate``, ZeRO-1, the same data (accelerate counts a step at
  the end of each loader pass);
* ``whole/*``: the Trainer with 4 micro-batches per rank and epoch: every window whole, nothing may change;
* ``uneven/with``: the ``trainer`` run with ``even_batches=False``, which the patch leaves to DeepSpeed;
* ``dsga/*``: the ``accumulate`` loop with ``Accelerator()`` left at its default accumulation (1: on accelerate < 1.8
  only DeepSpeed's config says 2), and ``noacc/*``: a ZeRO-2 loop that calls ``accelerator.backward`` without
  ``accumulate``: both left to DeepSpeed's count, unchanged;
* ``stale/with``: an ``accumulate`` loop left after 3 micro-batches, then the ``noacc`` loop in the same process
  without resetting accelerate's gradient state (as between two Trainers): left to DeepSpeed;
* ``undo/with``: a ZeRO-2 ``accumulate`` loop in which this patch is undone after the third micro-batch (a decision
  of false): DeepSpeed counts again from there.

Tags: ``without`` runs without zeroshim.  The rest run with zeroshim: ``reference`` and ``off`` with this patch
undone (``zeroshim.unpatch``), so that other patches acting on the same release (``zero2_accumulation_overwrite`` on
DeepSpeed 0.17.6 - 0.18.2) act in them too, ``with`` with it.  ``reference`` is the by-hand remedy, accelerate
1.8.0's ``DeepSpeedEngineWrapper.backward`` written out here (the boundary set to accelerate's ``sync_gradients``,
``engine.step()`` only there), put in place only where the installed accelerate's backward does not take
``sync_gradients``; ``off`` is the run as it is.  Each run records the optimizer steps the Trainer or accelerate
counted and the ones DeepSpeed took (``engine.global_steps``), its losses and a digest of the parameters, or its
error.
"""

import contextlib
import inspect
import tempfile

import torch

from common import attempt, begin, enable_zeroshim, end, import_deepspeed, param_digest
from tiny_mlp import Net, Rows

deepspeed = import_deepspeed()
NAME = "accelerate_accumulation_boundary"
MICRO, GA, EPOCHS, LR = 2, 2, 2, 1e-2


def _config(stage: int, auto: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto" if auto else MICRO,
            "gradient_accumulation_steps": "auto" if auto else GA, "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
            "fp16": {"enabled": False}, "bf16": {"enabled": False}}


@contextlib.contextmanager
def remedy(on: bool):
    """accelerate 1.8.0's engine-wrapper backward, by hand (where the installed one lacks it)."""
    from accelerate.state import GradientState
    from accelerate.utils import deepspeed as accelerate_deepspeed

    cls = accelerate_deepspeed.DeepSpeedEngineWrapper
    original = cls.__dict__["backward"]
    if not on or "sync_gradients" in inspect.signature(original).parameters:
        yield
        return

    def backward(self, loss, **kwargs):
        sync = GradientState().sync_gradients
        self.engine.set_gradient_accumulation_boundary(sync)
        self.engine.backward(loss, **kwargs)
        if sync:
            self.engine.step()

    cls.backward = backward
    try:
        yield
    finally:
        cls.backward = original


def _reset_accelerate(gradient_state: bool = True):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # one accelerator per run (accelerate keeps its state in singletons)
    if gradient_state:  # what transformers does not reset between two Trainers in one process
        GradientState._reset_state()


def trainer(rows: int, fix: bool, even_batches: bool = True) -> dict:
    from transformers import Trainer, TrainingArguments

    _reset_accelerate()
    world = torch.distributed.get_world_size()
    extra = {} if even_batches else {"accelerator_config": {"even_batches": False}}
    with tempfile.TemporaryDirectory() as out, remedy(fix):
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=GA,
                                 num_train_epochs=EPOCHS, learning_rate=LR, max_grad_norm=0.0, logging_steps=1,
                                 save_strategy="no", report_to=[], use_cpu=True, seed=0, deepspeed=_config(2, True),
                                 disable_tqdm=True, dataloader_num_workers=0, **extra)
        run = Trainer(model=Net(), args=args, train_dataset=Rows(rows * world))
        run.train()
        engine = run.model_wrapped
        return {"counted": run.state.global_step, "stepped": engine.global_steps,
                "losses": [h["loss"] for h in run.state.log_history if "loss" in h], **param_digest(engine)}


def accumulate(fix: bool, stage: int = 1, ours: "int | None" = GA, use_accumulate: bool = True,
               undo_at: "int | None" = None, stop_after: "int | None" = None, fresh: bool = True) -> dict:
    """A loop over a prepared loader, 5 micro-batches per rank and pass.  ``ours``: the accumulation steps given to
    ``Accelerator`` (None: left at its default); ``use_accumulate``: each micro-batch under
    ``accelerator.accumulate``; ``undo_at``: ``zeroshim.unpatch`` this patch after that many micro-batches;
    ``stop_after``: leave the loop after that many; ``fresh``: reset accelerate's gradient state first."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    _reset_accelerate(gradient_state=fresh)
    extra = {} if ours is None else {"gradient_accumulation_steps": ours}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_config(stage, False)), **extra)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = 5 * MICRO * accelerator.num_processes  # 5 micro-batches per rank and pass (accelerate shards the loader)
    loader = torch.utils.data.DataLoader(Rows(rows), batch_size=MICRO)
    out = {}
    with remedy(fix):
        engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        counted, losses = 0, []
        for _ in range(EPOCHS):
            if stop_after is not None and len(losses) >= stop_after:
                break
            for batch in loader:
                with accelerator.accumulate(engine) if use_accumulate else contextlib.nullcontext():
                    loss = engine(batch["x"])["loss"]
                    accelerator.backward(loss)
                    counted += int(accelerator.sync_gradients)
                    optimizer.step()
                    optimizer.zero_grad()
                    losses.append(loss.item())
                if stop_after is not None and len(losses) == stop_after:
                    break
                if undo_at is not None and len(losses) == undo_at:
                    import zeroshim

                    out["stepped_at_undo"] = engine.global_steps
                    zeroshim.unpatch(NAME)
                    out["boundary_after_undo"] = vars(engine).get("_is_gradient_accumulation_boundary", "missing")
    return {**out, "counted": counted, "stepped": engine.global_steps, "losses": losses, **param_digest(engine)}


def stale(fix: bool) -> dict:
    """A ZeRO-2 ``accumulate`` loop left in the middle of a window (after 3 micro-batches: accelerate's sync state
    false), then, in the same process and without resetting accelerate's gradient state, the ``noacc`` loop: the
    second run's result."""
    accumulate(fix, stage=2, stop_after=3)
    return accumulate(fix, stage=2, use_accumulate=False, fresh=False)


def main():
    out, results = begin()
    results["trainer/without"] = attempt(trainer, 5 * MICRO, False)
    results["accumulate/without"] = attempt(accumulate, False)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()[NAME].as_dict()

    def stats():
        return dict(zeroshim.stats(NAME))

    zeroshim.unpatch(NAME)  # the references: zeroshim without this patch
    results["trainer/reference"] = attempt(trainer, 5 * MICRO, True)
    results["accumulate/reference"] = attempt(accumulate, True)
    results["trainer/off"] = attempt(trainer, 5 * MICRO, False)
    results["whole/off"] = attempt(trainer, 4 * MICRO, False)
    results["dsga/off"] = attempt(accumulate, False, ours=None)
    results["noacc/off"] = attempt(accumulate, False, stage=2, use_accumulate=False)
    results["stale/off"] = attempt(stale, False)
    zeroshim.apply(NAME)
    results["trainer/with"] = attempt(trainer, 5 * MICRO, False)
    results["accumulate/with"] = attempt(accumulate, False)
    before = stats()
    results["whole/with"] = attempt(trainer, 4 * MICRO, False)
    results["whole_differed"] = stats()["differed"] - before["differed"]
    results["uneven/with"] = attempt(trainer, 5 * MICRO, False, even_batches=False)
    results["uneven_left"] = stats()["uneven"]
    before = stats()
    results["dsga/with"] = attempt(accumulate, False, ours=None)
    results["noacc/with"] = attempt(accumulate, False, stage=2, use_accumulate=False)
    results["stale/with"] = attempt(stale, False)
    results["left"] = stats()["left"] - before["left"]
    results["stats"] = stats()  # before the undo, which clears them
    results["undo/with"] = attempt(accumulate, False, stage=2, undo_at=3)
    zeroshim.apply(NAME)
    end(out, results)


if __name__ == "__main__":
    main()
