"""One configuration of the differential matrix on one rank (run under torchrun by
tests/differential/run.py): a tiny token model built from the configuration's axes,
trained for a few optimizer steps with raw ``deepspeed.initialize`` or with HF
``Trainer`` (axis ``api``), without or with zeroshim (``--mode``).  Writes
``<out>/rank<R>.json``: the losses of every micro-step, a digest of the parameters as
this rank holds them, whether the trainable parameters moved, and the error if
training raised.  A watchdog records ``hang`` and ends the
process when a collective never returns (ranks that disagree)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time

STEPS = 3  # optimizer steps
FP16_STEPS = 5  # fp16: the first steps overflow at the initial loss scale and are skipped (see ds_config)
VOCAB, WIDTH, SEQ, MICRO_BATCH = 64, 32, 8, 2


def steps(cfg) -> int:
    return FP16_STEPS if cfg["dtype"] == "fp16" else STEPS


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["without", "with"], required=True)
    parser.add_argument("--config", required=True, help="the configuration, as JSON")
    parser.add_argument("--timeout", type=float, default=150)
    return parser.parse_args()


def main():
    args = parse()
    cfg = json.loads(args.config)
    if args.mode == "with":
        import zeroshim  # noqa: F401  (the user's first line)
    from common import describe, import_deepspeed, init_distributed, write_results

    results = {"mode": args.mode, "config": cfg}
    done = threading.Event()

    def watchdog():
        if not done.wait(args.timeout):
            results.setdefault("error", "hang")
            results["ok"] = False
            write_results(args.out, results)
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    deepspeed = import_deepspeed()
    if cfg["dtype"] == "fp16" and os.environ.get("ZS_DIFF_FP16_ON_CPU") == "1":
        results["fp16_on_cpu"] = fp16_on_cpu()
    rank, world = init_distributed()
    try:
        results.update((train_trainer if cfg.get("api") == "trainer" else train)(deepspeed, cfg, rank), ok=True)
    except Exception as exc:  # a failing configuration is a result
        results.update(ok=False, error=describe(exc))
        done.set()
        write_results(args.out, results)
        sys.stdout.flush()
        # another rank may be blocked in a collective this one never joins: no barrier, no teardown
        time.sleep(2)
        os._exit(1)
    done.set()
    if "zeroshim" in sys.modules:
        z = sys.modules["zeroshim"]
        # every patch's non-zero counters (what it did, or looked at and left alone)
        results["counters"] = {name: {k: v for k, v in z.stats(name).items() if isinstance(v, (int, float)) and v}
                               for name in z.status()}
        results["counters"] = {k: v for k, v in results["counters"].items() if v}
    write_results(args.out, results)
    from common import finish

    finish()


def fp16_on_cpu() -> bool:
    """Harness adaptation, the same in both runs: DeepSpeed's CPU accelerator refuses fp16 where oneDNN
    has no fp16 kernels (``is_fp16_supported``), although torch computes fp16 on a CPU with its own
    kernels.  Declaring it supported runs DeepSpeed's fp16 path (loss scaling, overflow-skipped
    steps) unchanged; only the capability check is answered.  True if it was needed."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu" or acc.is_fp16_supported():
        return False
    acc.is_fp16_supported = lambda: True
    return True


def build(cfg):
    import torch
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(WIDTH)
            self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
            self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

        def forward(self, h):
            return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(WIDTH, VOCAB)

        def run_block(self, block, h):
            mode = cfg["ckpt"]
            if mode == "none" or not self.training:
                return block(h)
            if mode == "omitted":  # torch warns and takes the reentrant variant
                return checkpoint(block, h)
            return checkpoint(block, h, use_reentrant=(mode == "reentrant"))

        def forward(self, ids, labels):
            h = self.emb(ids)
            if cfg["input_grad"] == "forced" and not h.requires_grad:  # as enable_input_require_grads
                h.requires_grad_(True)
            for block in self.blocks:
                h = self.run_block(block, h)
            if cfg["twice"]:  # the same module twice in one step (shared layer)
                h = self.run_block(self.blocks[0], h)
            logits = self.head(h).float()
            return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))

    torch.manual_seed(0)
    net = Net()
    if cfg["training"] == "lora":
        from peft import LoraConfig, get_peft_model

        for p in net.parameters():
            p.requires_grad_(False)
        net = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"], lora_dropout=0.0,
                                             init_lora_weights="gaussian"))
    elif cfg["training"] == "frozen_part":
        for p in list(net.emb.parameters()) + list(net.blocks[0].parameters()):
            p.requires_grad_(False)
    return net


def ds_config(cfg, world):
    zero = {"stage": cfg["stage"]}
    if cfg["offload"] in ("optimizer", "optimizer+param"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if cfg["offload"] == "optimizer+param":
        zero["offload_param"] = {"device": "cpu"}
    if cfg["stage"] == 3 and cfg["persistence"] == "0":
        zero["stage3_param_persistence_threshold"] = 0
    out = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": cfg["ga"],
           "train_batch_size": MICRO_BATCH * cfg["ga"] * world, "zero_optimization": zero,
           "gradient_clipping": cfg["clip"], "zero_allow_untested_optimizer": True,
           "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if cfg["dtype"] == "bf16":
        out["bf16"] = {"enabled": True}
    elif cfg["dtype"] == "fp16":
        # dynamic loss scaling from 2**19: this model's gradients overflow fp16 there, so the first steps are
        # skipped (2-3 of 5 in the configurations tried: with hysteresis 2 the scale halves at the second
        # overflow) and the rest train; from 2**16 no step overflowed
        out["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 19}
    return out


def trainable_digest(net):
    digest = hashlib.sha256()
    for _, p in sorted(net.named_parameters()):
        if not p.requires_grad:
            continue
        t = getattr(p, "ds_tensor", None)
        t = (t if t is not None else p).detach().float().cpu().contiguous()
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


def train(deepspeed, cfg, rank):
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    net = build(cfg)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=ds_config(cfg, world))
    before = trainable_digest(engine.module)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps(cfg) * cfg["ga"]):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
        labels = (ids * 3 + 1) % VOCAB
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return outcome(engine, losses, before)


def outcome(engine, losses: list, before: str) -> dict:
    """What a rank records after training ``engine``: the losses, whether a trainable parameter moved
    since the digest ``before``, the parameter digest, and the steps fp16 skipped."""
    from common import param_digest

    out = {"losses": losses, "updated": trainable_digest(engine.module) != before,
           **{k: v for k, v in param_digest(engine).items() if k != "param_sums"}}
    skipped = getattr(engine, "skipped_steps", None)
    if skipped is not None:
        out["skipped_steps"] = int(skipped)
    return out


def train_trainer(deepspeed, cfg, rank):
    """The same model and steps through HF Trainer's DeepSpeed integration: the DeepSpeed config
    with Trainer's "auto" values, Trainer's AdamW (no weight decay) and a constant learning rate,
    ``use_cpu``; the batches in order (Trainer's sampler made sequential; each rank gets its
    slice), so that the runs without and with zeroshim see the same data."""
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from transformers import Trainer, TrainerCallback, TrainingArguments

    world = dist.get_world_size()
    net = build(cfg)

    class Wrapped(nn.Module):  # Trainer reads outputs["loss"]
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids, labels):
            return {"loss": self.inner(ids, labels)}

    gen = torch.Generator().manual_seed(100)
    rows = []
    for _ in range(steps(cfg) * cfg["ga"] * MICRO_BATCH * world):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
        rows.append({"ids": ids, "labels": (ids * 3 + 1) % VOCAB})
    config = ds_config(cfg, world)
    config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
                  train_batch_size="auto", gradient_clipping="auto")
    for key in ("bf16", "fp16"):
        if key in config:
            config[key]["enabled"] = "auto"
    output_dir = tempfile.TemporaryDirectory(prefix="zs-diff-")  # save_strategy "no": nothing is written there
    args = TrainingArguments(
        output_dir=output_dir.name, per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=cfg["ga"], max_steps=steps(cfg), learning_rate=1e-2, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=cfg["clip"], bf16=cfg["dtype"] == "bf16", fp16=cfg["dtype"] == "fp16",
        use_cpu=True, deepspeed=config, report_to=[], save_strategy="no", logging_steps=10**6, seed=0,
        data_seed=0, disable_tqdm=True, remove_unused_columns=False, dataloader_drop_last=True)
    losses, digests = [], {}

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            digests["before"] = trainable_digest(model)

    class Recording(Trainer):
        def compute_loss(self, model, inputs, *a, **k):
            loss = super().compute_loss(model, inputs, *a, **k)
            losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach().float()))
            return loss

        def _get_train_sampler(self, *a, **k):  # in order, as the raw loop's batches
            return torch.utils.data.SequentialSampler(self.train_dataset)

    trainer = Recording(model=Wrapped(net), args=args, train_dataset=rows, callbacks=[Record()])
    trainer.train()
    output_dir.cleanup()
    return outcome(trainer.model_wrapped, losses, digests["before"])


if __name__ == "__main__":
    main()
