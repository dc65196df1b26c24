"""Scenario for patch ``warmup_zero_steps``: DeepSpeed's warmup schedulers from the config with
``warmup_num_steps`` 0.  A 16 -> 32 -> 4 MLP, fp32, ZeRO-2, 2 ranks, 4 steps, learning rate 1e-3.

Runs, in one process per rank, each as ``reference``, ``without`` (no zeroshim) and ``with`` (zeroshim):

* ``WarmupLR/*``, ``WarmupDecayLR/*``, ``WarmupCosineLR/*``: ``deepspeed.initialize`` with the scheduler in the
  config, ``warmup_num_steps`` 0 (the reference: 1, which DeepSpeed <= 0.19.2 scheduled as it did 0:
  ``max(2, n)``);
* ``float/*``: ``WarmupLR`` with ``warmup_num_steps`` 3.0 (the reference: 3);
* ``trainer/*``: the HF Trainer with ``WarmupDecayLR`` and ``"warmup_num_steps": "auto"``, ``warmup_steps`` 0
  (the reference: ``warmup_steps`` 1).  transformers >= 5.18 fills ``max(1, 0)`` itself: there the run without
  zeroshim trains as the reference.

Each run records the learning rate after each step, the losses and a digest of the parameters, or its error.
"""

import tempfile

import torch

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest
from tiny_mlp import H, Net, Rows

deepspeed = import_deepspeed()
MICRO, STEPS, LR = 2, 4, 1e-3
SCHEDULERS = {"WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": LR},
              "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "total_num_steps": STEPS},
              "WarmupCosineLR": {"total_num_steps": STEPS}}
CASES = {"WarmupLR": ("WarmupLR", 0, 1), "WarmupDecayLR": ("WarmupDecayLR", 0, 1),
         "WarmupCosineLR": ("WarmupCosineLR", 0, 1), "float": ("WarmupLR", 3.0, 3)}


def raw(scheduler: str, warmup) -> dict:
    cfg = ds_config(2, micro_batch=MICRO, bf16=False)
    cfg["scheduler"] = {"type": scheduler, "params": {**SCHEDULERS[scheduler], "warmup_num_steps": warmup,
                                                      "warmup_type": "linear"}}
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
    gen = torch.Generator().manual_seed(3 + torch.distributed.get_rank())
    losses, lrs = [], []
    for _ in range(STEPS):
        loss = engine(torch.randn(MICRO, H, generator=gen))["loss"]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
    return {"scheduler": type(engine.lr_scheduler).__name__, "losses": losses, "lrs": lrs, **param_digest(engine)}


def trainer(warmup_steps: int) -> dict:
    from transformers import Trainer, TrainingArguments

    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
           "zero_allow_untested_optimizer": True, "bf16": {"enabled": False}, "fp16": {"enabled": False},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                             "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    world = torch.distributed.get_world_size()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO, max_steps=STEPS, learning_rate=LR,
                                 warmup_steps=warmup_steps, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                                 report_to=[], use_cpu=True, seed=0, deepspeed=cfg, disable_tqdm=True,
                                 dataloader_num_workers=0)
        run = Trainer(model=Net(), args=args, train_dataset=Rows(MICRO * world * STEPS))
        run.train()
        logs = [h for h in run.state.log_history if "loss" in h]
        return {"scheduler": type(run.lr_scheduler).__name__, "losses": [h["loss"] for h in logs],
                "lrs": [h["learning_rate"] for h in logs], **param_digest(run.model_wrapped)}


def runs(results: dict, arm: str) -> None:
    for case, (scheduler, given, reference) in CASES.items():
        if arm == "without":
            results[f"{case}/reference"] = attempt(raw, scheduler, reference)
        results[f"{case}/{arm}"] = attempt(raw, scheduler, given)
    if arm == "without":
        results["trainer/reference"] = attempt(trainer, 1)
    results[f"trainer/{arm}"] = attempt(trainer, 0)


def main():
    out, results = begin()
    runs(results, "without")

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["warmup_zero_steps"].as_dict()
    runs(results, "with")
    results["stats"] = {"taken": [list(t) for t in zeroshim.stats("warmup_zero_steps")["taken"]]}
    end(out, results)


if __name__ == "__main__":
    main()
