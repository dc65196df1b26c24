"""Scenario for patch ``zero2_offload_accumulation``: ZeRO-2, ``offload_optimizer``
on the CPU, gradient accumulation.  A 32 -> 64 -> 8 MLP, AdamW, fp32 (so the
only difference offload may make is the one under test), 3 optimizer steps.

Runs, in one process per rank:

* ``reference/ga{N}/clip{C}``: ZeRO-2 without offload (what every micro-batch
  contributes);
* ``without/ga{N}/clip{C}``: offload, no zeroshim (on 0.15.2 <= DeepSpeed <
  0.19.0 the micro-batches between the first and the last are dropped);
* ``with/ga{N}/clip{C}``: offload with zeroshim;
* ``z1/{without,with}/ga4``: ZeRO-1 with offload, which calls the method once
  per step at the boundary: the patch must not change it.

Each records the per-micro-batch losses, the global gradient norm of each
step and every parameter value (ZeRO-2 keeps full parameters on each rank).

``--device cpu`` (default; CI): DeepSpeed's CPU accelerator over gloo; the
method under test, ``async_accumulate_grad_in_cpu_via_gpu``, then accumulates
on the CPU.  ``--device cuda`` (gpu marker, one GPU per rank, NCCL): the real
path, the gradients on the GPU and the accumulation buffer in host memory.
"""

import torch
import torch.nn as nn

from common import attempt, ds_config, enable_zeroshim, end, import_deepspeed, param_digest, versions

deepspeed = import_deepspeed()
STEPS, MICRO = 3, 2
DEVICE = "cpu"  # set by main(): "cpu" or "cuda:<local rank>"


def train(stage: int, ga: int, offload: bool, clip: float) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    cfg = ds_config(stage, micro_batch=MICRO, bf16=False, clip=clip, **zero)
    cfg["gradient_accumulation_steps"] = ga
    cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW on the offloaded partition (no CPU Adam JIT build)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses, norms = [], []
    for _ in range(STEPS):
        for _ in range(ga):
            x = torch.randn(MICRO, 32, generator=gen).to(DEVICE)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else None)
    return {"losses": losses, "grad_norms": norms, **param_digest(engine, values=True)}


def runs(tag: str, offload: bool) -> dict:
    out = {}
    for ga in (2, 3, 4):
        for clip in (0.0, 1.0):
            out[f"{tag}/ga{ga}/clip{clip:g}"] = attempt(train, 2, ga, offload, clip)
    return out


def main():
    import argparse
    import os

    global DEVICE
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        DEVICE = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(DEVICE)
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    out, results = args.out, {"versions": versions(), "device": args.device}
    results.update(runs("reference", offload=False))
    results.update(runs("without", offload=True))
    results["z1/without/ga4"] = attempt(train, 1, 4, True, 1.0)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero2_offload_accumulation"].as_dict()
    results.update(runs("with", offload=True))
    before = zeroshim.stats("zero2_offload_accumulation")["copied_back"]
    results["z1/with/ga4"] = attempt(train, 1, 4, True, 1.0)
    results["z1_copied_back"] = zeroshim.stats("zero2_offload_accumulation")["copied_back"] - before
    end(out, results)


if __name__ == "__main__":
    main()
