"""Scenario for patch ``zero_optimizer_defaults``: transformers' ``cosine_with_min_lr`` schedule with ``min_lr`` on
DeepSpeed's optimizer.  A 16 -> 32 -> 4 MLP, fp32, 2 ranks, 4 steps, learning rate 1e-3, 1 warm-up step,
``min_lr`` 1e-5 (the reference: ``min_lr_rate`` 0.01, the same schedule written as a ratio, which reads nothing
from the optimizer).

Two paths, each run as ``reference``, ``without`` (no zeroshim) and ``with`` (zeroshim):

* ``trainer/*``: the HF Trainer, ZeRO-2, ``lr_scheduler_type="cosine_with_min_lr"``; on transformers >= 5.1 the
  Trainer builds the schedule on DeepSpeed's optimizer (through accelerate's wrapper), before 5.1 on its own;
* ``accelerate/*``: ``Accelerator.prepare`` of the model and a torch AdamW under ZeRO-3, then transformers'
  ``get_cosine_with_min_lr_schedule_with_warmup`` on the prepared optimizer (any release).

Patch ``zero3_gloo_gather`` stays on in the runs without zeroshim (it follows its own gate): the ZeRO-3 runs are
compared bit for bit.  Each run records the learning rate after each step, the losses and a digest of the
parameters, or its error.
"""

import tempfile

import torch

from common import attempt, begin, enable_zeroshim, end, import_deepspeed, param_digest
from tiny_mlp import H, Net, Rows

# ZeRO-3 runs compared bit for bit: patch zero3_gloo_gather stays on in the runs without zeroshim (its own gate;
# DeepSpeed's blocking gathers on gloo now and then read unwritten memory: see common.import_deepspeed)
deepspeed = import_deepspeed(fix_gloo_gathers=True)
MICRO, STEPS, LR = 2, 4, 1e-3
SCHEDULES = {"min_lr": {"min_lr": 1e-5}, "ratio": {"min_lr_rate": 0.01}}


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
            "fp16": {"enabled": False}, "bf16": {"enabled": False}, "gradient_clipping": 0.0}


def trainer(schedule: str) -> dict:
    from transformers import Trainer, TrainingArguments

    cfg = {**_config(2), "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto"}
    world = torch.distributed.get_world_size()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO, max_steps=STEPS, learning_rate=LR,
                                 lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs=SCHEDULES[schedule],
                                 warmup_steps=1, max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=True, seed=0, deepspeed=cfg, disable_tqdm=True, dataloader_num_workers=0)
        run = Trainer(model=Net(), args=args, train_dataset=Rows(MICRO * world * STEPS))
        run.train()
        logs = [h for h in run.state.log_history if "loss" in h]
        return {"optimizer": type(run.model_wrapped.optimizer).__name__, "losses": [h["loss"] for h in logs],
                "lrs": [h["learning_rate"] for h in logs], **param_digest(run.model_wrapped)}


def accelerate(schedule: str) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    AcceleratorState._reset_state(True)  # each run its own accelerator (the Trainer runs made theirs)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_config(3)))
    model = Net()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, num_warmup_steps=1,
                                                             num_training_steps=STEPS, **SCHEDULES[schedule])
    gen = torch.Generator().manual_seed(3 + torch.distributed.get_rank())
    losses, lrs = [], []
    for _ in range(STEPS):
        loss = model(torch.randn(MICRO, H, generator=gen))["loss"]
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        lrs.append(optimizer.param_groups[0]["lr"])
    return {"optimizer": type(model.optimizer).__name__, "losses": losses, "lrs": lrs, **param_digest(model)}


def main():
    out, results = begin()
    for path, run in (("trainer", trainer), ("accelerate", accelerate)):
        results[f"{path}/reference"] = attempt(run, "ratio")
        results[f"{path}/without"] = attempt(run, "min_lr")

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero_optimizer_defaults"].as_dict()
    for path, run in (("trainer", trainer), ("accelerate", accelerate)):
        results[f"{path}/with"] = attempt(run, "min_lr")
    results["stats"] = dict(zeroshim.stats("zero_optimizer_defaults"))
    end(out, results)


if __name__ == "__main__":
    main()
