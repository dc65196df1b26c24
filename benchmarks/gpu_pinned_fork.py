"""``offload_worker_fork`` on CUDA with pinned offload buffers (run once on a GPU machine).

On the CPU accelerator ``pin_memory`` changes nothing; on CUDA DeepSpeed page-locks
the offloaded optimizer state and parameter partitions (``tensor.pin_memory()``).
This run asks what happens to those pages when DataLoader workers are forked:
ZeRO-3 with optimizer and parameter offload (``pin_memory: true``), bf16, a
~50M-parameter MLP, one rank (NCCL), a DataLoader with 2 workers re-forked each
of 2 epochs; ``without`` and ``with`` zeroshim in separate processes.  Prints one
JSON line: losses, the patch's counters (buffers and bytes it marked, ``dc``
ranges it found already marked by someone else, ``madvise`` refusals), the
workers' PSS at the last batch of each epoch, and whether the ranges DeepSpeed
pinned carried ``dc`` (VM_DONTCOPY) before any fork.

    python benchmarks/gpu_pinned_fork.py without
    python benchmarks/gpu_pinned_fork.py with
"""

import json
import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "with"
if MODE == "with":
    import zeroshim  # noqa: F401

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def pss_kib(pid):
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("Pss:"))


def dontcopy_kib():
    """KiB of this process's mappings that carry the ``dc`` flag (VM_DONTCOPY) now."""
    total, size, = 0, 0
    with open("/proc/self/smaps") as fh:
        for line in fh:
            if line.startswith("Size:"):
                size = int(line.split()[1])
            elif line.startswith("VmFlags:") and " dc" in line:
                total += size
    return total


def main():
    import deepspeed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(0)
    width = 2048
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(12)])
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                    "offload_param": {"device": "cpu", "pin_memory": True}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=config)
    dc_before = dontcopy_kib()
    data = torch.utils.data.TensorDataset(torch.randn(16, width, generator=torch.Generator().manual_seed(1)))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2)
    losses, workers_pss = [], []
    for _ in range(2):
        it = iter(loader)
        pids = [w.pid for w in it._workers]
        for i, (x,) in enumerate(it):
            loss = engine(x.cuda().to(torch.bfloat16)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if i == len(loader) - 1:
                workers_pss.append(sum(pss_kib(p) for p in pids if os.path.exists(f"/proc/{p}")))
    out = {"mode": MODE, "deepspeed": deepspeed.__version__, "torch": torch.__version__, "losses": losses,
           "workers_pss_mib": [round(k / 1024, 1) for k in workers_pss], "parent_pss_mib": round(pss_kib(os.getpid()) / 1024, 1),
           "dontcopy_mib_before_any_fork": round(dc_before / 1024, 1)}
    if MODE == "with":
        out["stats"] = sys.modules["zeroshim"].stats("offload_worker_fork")
        out["status"] = sys.modules["zeroshim"].status()["offload_worker_fork"].state
    print("RESULT " + json.dumps(out), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
