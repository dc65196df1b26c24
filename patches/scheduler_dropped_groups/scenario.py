"""Scenario for patch ``scheduler_dropped_groups``: an LR scheduler built on an optimizer with an empty
param group before DeepSpeed removes that group.

Two ways in, each with ZeRO-2 and ZeRO-3 (fp32, 2 ranks):

* ``trainer_z2``/``trainer_z3``: HF Trainer, a tiny Llama built from a config, peft LoRA on
  ``q_proj``/``v_proj`` (no bias: Trainer's no-decay group is empty), cosine schedule with 2 warmup
  steps, 5 steps, the DeepSpeed config given to ``TrainingArguments``.  transformers < 5.1 builds the
  scheduler before ``deepspeed.initialize``; 5.1+ after it (transformers#43711).
* ``raw_z2``/``raw_z3``: ``deepspeed.initialize(model, optimizer=AdamW([empty group, LoRA-like
  group]), lr_scheduler=LambdaLR(...))`` with a different base LR and schedule per group (the empty
  group first), 5 steps, after loading a scheduler state saved with both groups (what a run without
  the fix saves).  Any transformers.

Result keys, each a dict of those cases:

* ``reference``: the empty group never existed (Trainer: pruned in ``create_optimizer``, before the
  scheduler; raw: the optimizer and scheduler built from the non-empty group alone);
* ``without``: no zeroshim (torch >= 2.10: ``ValueError: zip() argument 2 is longer than argument 1``);
* ``with``: zeroshim.

Extras: ``no_deepspeed`` (the Trainer LoRA run without DeepSpeed, DDP on gloo, run first: the LRs the
schedule prescribes), ``harmless`` (a full fine-tune, whose no-decay group is not empty, without and with
zeroshim), ``stats`` (the patch's counters).  Each run records its exact losses, the LR of every group
at every step, the scheduler's final ``base_lrs``/``_last_lr`` and a digest of the parameters.
"""

import functools
import math
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from common import attempt, begin, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
STEPS = 5
RESUMED = 2  # raw runs: scheduler steps in the state loaded before training


# -- HF Trainer ------------------------------------------------------------------------------------------
def _llama(lora: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, set_seed

    set_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def trainer_run(stage: int, lora: bool = True, prune: bool = False) -> dict:
    """``stage`` 0: no DeepSpeed.  ``prune``: drop empty groups before Trainer builds its scheduler."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    lrs, losses = [], []

    class Record(TrainerCallback):
        trainer = None

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            optimizer = optimizer or self.trainer.optimizer  # transformers 4.49 passes None
            lrs.append([g["lr"] for g in optimizer.param_groups])

    class Run(Trainer):
        def create_optimizer(self):
            optimizer = super().create_optimizer()
            if prune:  # what the frameworks' own fixes do (ms-swift#9173, OpenRLHF#1234)
                optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
            return optimizer

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append(float(loss.detach()))
            return loss

    model = _llama(lora)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": i, "labels": i} for i in ids]
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}} if stage else None
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-2,
                                 lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1, save_strategy="no",
                                 report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
                                 deepspeed=config)
        record = Record()
        trainer = record.trainer = Run(model=model, args=args, train_dataset=data, callbacks=[record])
        groups = len(trainer.create_optimizer().param_groups) if not stage else None
        trainer.train()
    scheduler = trainer.lr_scheduler
    scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler
    return {"losses": losses, "lrs": lrs, "groups_without_deepspeed": groups, "deepspeed": trainer.is_deepspeed_enabled,
            "base_lrs": list(scheduler.base_lrs), "last_lr": list(scheduler.get_last_lr()),
            **param_digest(trainer.model_wrapped)}


# -- deepspeed.initialize --------------------------------------------------------------------------------
class Net(nn.Module):
    """A frozen base and a trainable low-rank adapter (no bias, nothing for a no-decay group)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.a = nn.Linear(8, 2, bias=False)
        self.b = nn.Linear(2, 8, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x):
        return (self.base(x) + self.b(self.a(x))).pow(2).mean()


def _warmup_cosine(step, warmup=2, total=STEPS + RESUMED):
    if step < warmup:
        return step / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def _constant(step):
    return 1.0


# one schedule per group, as partial objects (HF's schedules are too: their state is saved per group)
EMPTY_LAMBDA, KEPT_LAMBDA = functools.partial(_constant), functools.partial(_warmup_cosine)


def _groups(params, empty: bool):
    kept = {"params": params, "lr": 1e-2, "weight_decay": 0.1}
    return ([{"params": [], "lr": 5e-2, "weight_decay": 0.0}, kept], [EMPTY_LAMBDA, KEPT_LAMBDA]) if empty \
        else ([kept], [KEPT_LAMBDA])


def _saved_state(empty: bool) -> dict:
    """The state a scheduler of this layout saves after ``RESUMED`` steps on plain torch."""
    groups, lambdas = _groups([torch.zeros(1, requires_grad=True)], empty)
    optimizer = torch.optim.AdamW(groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    for _ in range(RESUMED):
        optimizer.step()
        scheduler.step()
    return scheduler.state_dict()


def raw_run(stage: int, empty: bool) -> dict:
    torch.manual_seed(0)
    model = Net()
    groups, lambdas = _groups([p for p in model.parameters() if p.requires_grad], empty)
    optimizer = torch.optim.AdamW(groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, _, _, sched = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=config)
    sched.load_state_dict(_saved_state(empty))  # resuming from a checkpoint saved with every group
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    losses, lrs = [], []
    for _ in range(STEPS):
        lrs.append([g["lr"] for g in engine.optimizer.param_groups])
        loss = engine(torch.randn(2, 8, generator=gen))
        engine.backward(loss)
        engine.step()  # steps the scheduler
        losses.append(loss.item())
    state = sched.state_dict()
    return {"losses": losses, "lrs": lrs, "base_lrs": list(sched.base_lrs), "last_lr": list(sched.get_last_lr()),
            "state": {k: state[k] for k in ("base_lrs", "_last_lr", "last_epoch", "_step_count")},
            **param_digest(engine)}


def cases(prune: bool) -> dict:
    out = {}
    for stage in (2, 3):
        out[f"trainer_z{stage}"] = attempt(trainer_run, stage, True, prune)
        out[f"raw_z{stage}"] = attempt(raw_run, stage, not prune)
    return out


def main():
    out, results = begin()
    # first: TrainingArguments(deepspeed=...) leaves DeepSpeed switched on for later Trainers of the process
    results["no_deepspeed"] = attempt(trainer_run, 0, True)
    results["reference"] = cases(prune=True)
    results["without"] = cases(prune=False)
    results["harmless"] = {"without": attempt(trainer_run, 3, False)}
    zeroshim = enable_zeroshim()
    from zeroshim.patches import scheduler_dropped_groups as patch

    results["status"] = zeroshim.status()["scheduler_dropped_groups"].as_dict()
    results["with"] = cases(prune=False)
    results["stats"] = dict(patch.stats)
    results["harmless"]["with"] = attempt(trainer_run, 3, False)
    results["harmless"]["stats"] = {k: v - results["stats"][k] for k, v in patch.stats.items()}  # what it did there
    end(out, results)


if __name__ == "__main__":
    main()
