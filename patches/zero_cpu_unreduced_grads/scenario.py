"""Scenario for patch ``zero_cpu_unreduced_grads``: ZeRO-1/2 with ``contiguous_gradients: false`` on DeepSpeed's CPU
accelerator, an 8 -> 16 -> 4 MLP, client SGD (lr 0.1), 2 ranks, each its own data, 3 optimizer steps.

Cases: ``1/fp32``, ``2/fp32`` (``overlap_comm`` true), ``2/bf16``, ``2/fp32/ga2`` (gradient accumulation 2).  Runs per
case, in one process per rank:

* ``reference``: the same with ``contiguous_gradients: true`` (DeepSpeed's contiguous path, which all-reduces on
  every release; in fp32 it equals a single process stepping with the averaged gradient bit for bit: RESULTS);
* ``without``: ``contiguous_gradients: false``, no zeroshim (DeepSpeed < 0.19.8: no all-reduce, each rank steps its
  partition with its own gradient);
* ``with``: the same with zeroshim (as the reference);
* ``clean/with``: the reference's config with zeroshim (the contiguous path never reaches the wrapped function):
  equal to the reference;

and ``one_process``: the fp32 model trained in one process without DeepSpeed on the averaged gradient (what the fp32
references without accumulation must equal, bit for bit).
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
STEPS, MICRO = 3, 2
CASES = {"1/fp32": dict(stage=1, bf16=False), "2/fp32": dict(stage=2, bf16=False, overlap_comm=True),
         "2/bf16": dict(stage=2, bf16=True), "2/fp32/ga2": dict(stage=2, bf16=False, ga=2)}


def train(stage, bf16, contiguous, ga=1, **zero) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    cfg = ds_config(stage, micro_batch=MICRO, bf16=bf16, contiguous_gradients=contiguous, **zero)
    cfg["gradient_accumulation_steps"] = ga
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS * ga):
        x = torch.randn(MICRO, 8, generator=gen)
        loss = engine(x.to(torch.bfloat16) if bf16 else x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "optimizer": type(engine.optimizer).__name__, **param_digest(engine)}


def one_process(steps=STEPS) -> dict:
    """The fp32 run without DeepSpeed, in this process alone: the same model and data, each step on the gradient
    averaged over both ranks' micro-batches (each rank's loss halved, as DeepSpeed halves each rank's gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(2)]
    for _ in range(steps):
        optimizer.zero_grad()
        for gen in gens:
            (model(torch.randn(MICRO, 8, generator=gen)).pow(2).mean() / 2).backward()
        optimizer.step()
    import hashlib

    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().float().contiguous().numpy().tobytes())
    return {"param_sha256": digest.hexdigest()}


def main():
    out, results = begin()
    results["one_process"] = attempt(one_process)
    for case, kw in CASES.items():
        results[f"{case}/reference"] = attempt(train, contiguous=True, **kw)
        results[f"{case}/without"] = attempt(train, contiguous=False, **kw)

    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()["zero_cpu_unreduced_grads"].as_dict()
    for case, kw in CASES.items():
        results[f"{case}/with"] = attempt(train, contiguous=False, **kw)
        results[f"{case}/clean/with"] = attempt(train, contiguous=True, **kw)
    results["stats"] = dict(zeroshim.stats("zero_cpu_unreduced_grads"))
    end(out, results)


if __name__ == "__main__":
    main()
