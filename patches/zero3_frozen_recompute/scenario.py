"""Scenario for patch ``zero3_frozen_recompute``.

A tiny LlamaForCausalLM built under ``deepspeed.zero.Init`` (ZeRO-3,
``stage3_param_persistence_threshold: 0``, bf16), peft LoRA on q_proj/v_proj
(base weights frozen), gradient checkpointing of every decoder layer.  Runs,
in one process per rank:

* ``without/nonreentrant`` - no zeroshim, ``use_reentrant=False``: fails on
  DeepSpeed < 0.19.3 with "Recomputed values ... have different metadata";
* ``reference`` - no zeroshim, no checkpointing (works on every release): the
  losses and parameters checkpointing must reproduce exactly;
* ``with/nonreentrant`` - zeroshim imported, ``use_reentrant=False``;
* ``with/reentrant`` - zeroshim imported, ``use_reentrant=True`` asked for (as
  transformers < 5 does by default): patch nonreentrant_checkpoint turns it
  into the non-reentrant path this patch must then carry;
* ``without/reentrant`` and ``with/reentrant_kept`` (nonreentrant_checkpoint
  off) - a reentrant recompute, which works on every release and which this
  patch must leave alone (same gathered peak);
* ``tail_norm/{without,reference,with}`` - :class:`TailNormNet`, whose first
  block's input needs no grad: the submodule in backward when that block is
  re-run never sees its post-backward hook fire; what the patch kept for it
  must be released at the end of backward.

Every run records its losses, its parameter shards, the parameters left
gathered after each backward and each step, and the peak number of gathered
parameter elements during backward (prefetching off, so that only what the
hooks keep is gathered).  ``--only NAME`` runs one of them (benchmarks and
debugging).
"""

import argparse
import sys

import torch

from common import (attempt, ds_config, enable_zeroshim, end, import_deepspeed, init_distributed, param_digest, versions)

deepspeed = import_deepspeed()

from tiny_lora import MICRO_BATCH, batch, build_model, fill_shards  # noqa: E402  (after DeepSpeed)

STEPS = 3


def lora_ds_config(**zero) -> dict:
    # No prefetching and no reuse window: what is gathered is what the hooks hold.
    zero = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0,
            **zero}
    return ds_config(3, micro_batch=MICRO_BATCH, **zero)


def left_gathered(model) -> int:
    """Parameters that are not persistent and not partitioned right now."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(1 for p in model.parameters()
               if hasattr(p, "ds_status") and not getattr(p, "ds_persist", False)
               and p.ds_status != ZeroParamStatus.NOT_AVAILABLE)


class GatherMeter:
    """Peak of gathered (full) parameter elements, sampled after every
    ``fetch_sub_module`` while ``active`` (during backward).  Instrumentation of
    the test only: the coordinator's method is replaced and restored around the run."""

    def __init__(self, model):
        from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.params = [p for p in model.parameters() if hasattr(p, "ds_numel")]
        self.available = ZeroParamStatus.AVAILABLE
        self.cls = ppc.PartitionedParameterCoordinator
        self.original = self.cls.__dict__["fetch_sub_module"]
        self.active = False
        self.peak = 0
        meter = self

        def fetch_sub_module(coordinator, *args, **kwargs):
            result = meter.original(coordinator, *args, **kwargs)
            if meter.active:
                meter.peak = max(meter.peak, meter.gathered())
            return result

        self.cls.fetch_sub_module = fetch_sub_module

    def gathered(self) -> int:
        return sum(p.ds_numel for p in self.params if p.ds_status == self.available)

    def close(self):
        self.cls.fetch_sub_module = self.original


class TailNormBlock(torch.nn.Module):
    """A frozen projection, then a trainable norm: when the block's input needs
    no grad, the norm's backward re-runs the block, and DeepSpeed's post-backward
    hooks of the norm and the block never fire (nothing flows to their inputs)."""

    def __init__(self, width=16):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.proj.requires_grad_(False)

    def forward(self, h):
        return self.norm(self.proj(h))


class TailNormNet(torch.nn.Module):
    def __init__(self, checkpointing):
        super().__init__()
        self.blocks = torch.nn.ModuleList(TailNormBlock() for _ in range(2))
        self.checkpointing = checkpointing

    def forward(self, x):
        h = x  # needs no grad
        for block in self.blocks:
            if self.checkpointing:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.checkpointing == "reentrant")
            else:
                h = block(h)
        return h.float().pow(2).mean()


def build_tail_norm(config, checkpointing):
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = TailNormNet(checkpointing)
    fill_shards(model, scale=0.3)
    return model


def train(checkpointing, steps: int = STEPS, layers: int = 2, hidden: int = 32, kind: str = "lora") -> dict:
    """``checkpointing``: None (off), "nonreentrant" or "reentrant"; ``kind``:
    "lora" (the Llama) or "tail_norm" (:class:`TailNormNet`)."""
    config = lora_ds_config()
    rank = torch.distributed.get_rank()
    if kind == "tail_norm":
        model = build_tail_norm(config, checkpointing)

        def loss_of(engine, step):
            x = torch.randn(MICRO_BATCH, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
            return engine(x.to(torch.bfloat16))
    else:
        model = build_model(config, layers=layers, hidden=hidden)
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
            model.enable_input_require_grads()

        def loss_of(engine, step):
            ids = batch(step, rank)
            return engine(input_ids=ids, labels=ids, use_cache=False).loss
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    engine.train()
    initial = param_digest(engine)["param_sha256"]
    meter = GatherMeter(engine.module)
    losses, after_backward, after_step = [], [], []
    try:
        for step in range(steps):
            loss = loss_of(engine, step)
            meter.active = True
            engine.backward(loss)
            meter.active = False
            after_backward.append(left_gathered(engine.module))
            engine.step()
            after_step.append(left_gathered(engine.module))
            losses.append(float(loss.detach().float()))
    finally:
        meter.close()
    total = sum(p.ds_numel for p in meter.params)
    return {"losses": losses, "left_gathered_after_backward": after_backward,
            "left_gathered_after_step": after_step, "peak_gathered_numel": meter.peak,
            "total_numel": total, "initial_sha256": initial, **param_digest(engine)}


RUNS = {  # name -> (zeroshim, checkpointing, patches turned off, train() keywords); runs without zeroshim first
    "without/nonreentrant": (False, "nonreentrant", (), {}),
    "without/reentrant": (False, "reentrant", (), {}),
    "reference": (False, None, (), {}),
    "tail_norm/without": (False, "nonreentrant", (), {"kind": "tail_norm"}),
    "tail_norm/reference": (False, None, (), {"kind": "tail_norm"}),
    "with/nonreentrant": (True, "nonreentrant", (), {}),
    "with/reentrant": (True, "reentrant", (), {}),
    # reentrant kept (patch nonreentrant_checkpoint off): zero3_frozen_recompute must leave its recompute alone
    "with/reentrant_kept": (True, "reentrant", ("nonreentrant_checkpoint",), {}),
    # post-backward hooks that never fire: what was kept is released at the end of backward
    "tail_norm/with": (True, "nonreentrant", (), {"kind": "tail_norm"}),
}


def frozen_recompute_stats():
    module = sys.modules.get("zeroshim.patches.zero3_frozen_recompute")
    return dict(module.stats) if module is not None else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=sorted(RUNS), action="append", help="run only these (repeatable)")
    args = parser.parse_args()
    init_distributed()
    results = {"versions": versions()}
    for name, (with_zeroshim, checkpointing, off, kwargs) in RUNS.items():
        if args.only and name not in args.only:
            continue
        if with_zeroshim:
            zeroshim = enable_zeroshim()  # (also forgets the previous run's configure())
            zeroshim.configure(**{patch: "off" for patch in off})
            results["status"] = {k: v.as_dict() for k, v in zeroshim.status().items()}
        before = frozen_recompute_stats()
        results[name] = attempt(train, checkpointing, **kwargs)
        after = frozen_recompute_stats()
        if after is not None:
            results[name]["patch_stats"] = {k: after[k] - before[k] for k in after}
    end(args.out, results)


if __name__ == "__main__":
    sys.exit(main())
