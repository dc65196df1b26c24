"""Host memory across epochs with ZeRO offload and DataLoader workers (issue #16).

ZeRO-3 with ``offload_optimizer`` and ``offload_param`` on the CPU, a stack of
``--layers`` x Linear(``--width``, ``--width``), a custom training loop over a
torch DataLoader (XTuner/mmengine style) re-iterated every epoch.  Memory is
measured with the meters that see copy-on-write sharing:

* system: MemTotal - MemAvailable (``/proc/meminfo``), the whole machine;
* PSS of the rank and all its children (DataLoader workers) summed
  (``/proc/<pid>/smaps_rollup``): shared pages are split between the
  processes sharing them, copied ones counted in full.  RSS double-counts
  what a fork shares; USS hides what the workers of one rank share.

Driver (runs each configuration as its own torchrun launch and prints a table):

    python benchmarks/epoch_memory.py --compare                    # the RESULTS.md table
    python benchmarks/epoch_memory.py --compare --configs none,workers,workers+zeroshim --layers 16 --width 1024

Configurations: ``none`` (no workers), ``workers`` (2 workers, re-forked every
epoch: torch's and HF Trainer's default ``persistent_workers=False``),
``persistent`` (``persistent_workers=True``), ``forkserver`` (a forkserver
multiprocessing context: needs this script's ``__main__`` guard and a
picklable dataset).  Suffixes: ``+zeroshim`` imports zeroshim (every patch,
``offload_worker_fork`` among them); ``+nofork`` turns
``offload_worker_fork`` off; ``+call`` calls ``zeroshim.epoch_boundary(engine)``
after every epoch (what a custom loop does to get ``epoch_boundary``'s
freeing; it implies importing zeroshim).

One worker (what the driver launches):

    torchrun --nproc_per_node 2 benchmarks/epoch_memory.py --config workers+zeroshim --out r.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

from _launch import system_used_mb as _system_used_mb

HERE = os.path.dirname(os.path.abspath(__file__))


# -- meters -----------------------------------------------------------------------------
def system_used_mb() -> float:
    """zeroshim's MemTotal - MemAvailable (MiB); raises where it cannot be read: this benchmark measures
    nothing without it."""
    used = _system_used_mb()
    if used is None:
        raise OSError("/proc/meminfo: MemTotal or MemAvailable cannot be read")
    return used


def pss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def tree_pss_mb() -> "tuple[float, int]":
    """PSS of this process and its children (recursively), and the number of children."""
    import psutil

    children = psutil.Process().children(recursive=True)
    return pss_mb(os.getpid()) + sum(pss_mb(c.pid) for c in children), len(children)


# -- the training run -----------------------------------------------------------------
class Inputs:
    """A map-style dataset of deterministic inputs (picklable: forkserver needs it)."""

    def __init__(self, n, width):
        self.n, self.width = n, width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        return torch.randn(self.width, generator=torch.Generator().manual_seed(i))


def worker(args):
    base, *flags = args.config.split("+")
    unknown = set(flags) - {"zeroshim", "nofork", "call"}
    if unknown:
        raise SystemExit(f"unknown configuration suffix(es): {', '.join(sorted(unknown))}")
    if "nofork" in flags:
        os.environ["ZEROSHIM_OFFLOAD_WORKER_FORK"] = "off"
    if flags:
        import zeroshim
    import deepspeed
    import torch
    import torch.nn as nn

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    before_model = system_used_mb()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    config = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=config)
    data = Inputs(args.batch * world * args.steps, args.width)
    sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True)
    loader_kw = {}
    if base in ("workers", "persistent", "forkserver"):
        loader_kw = {"num_workers": args.workers, "persistent_workers": base == "persistent"}
        if base == "forkserver":
            loader_kw["multiprocessing_context"] = "forkserver"
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, sampler=sampler, **loader_kw)
    samples, losses = [], []
    start = time.time()
    after_init = system_used_mb()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, x in enumerate(loader):
            loss = engine(x.to(torch.bfloat16)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            pss, children = tree_pss_mb()
            samples.append({"epoch": epoch, "step": step, "system": system_used_mb(), "pss": pss,
                            "children": children})
        if "call" in flags:
            zeroshim.epoch_boundary(engine)
    result = {"config": args.config, "rank": rank, "world": world, "before_model": before_model,
              "after_init": after_init, "samples": samples, "losses": losses, "time": time.time() - start,
              "params": sum(p.ds_numel for p in model.parameters())}
    if "zeroshim" in sys.modules:
        from zeroshim.patches import offload_worker_fork

        result["zeroshim"] = {k: v.state for k, v in sys.modules["zeroshim"].status().items()}
        result["fork_stats"] = dict(offload_worker_fork.stats)
    torch.distributed.barrier()
    if args.out:
        with open(f"{args.out}.rank{rank}", "w") as fh:
            json.dump(result, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # before interpreter exit (zeroshim/scenarios/common.py: finish)


# -- driver ---------------------------------------------------------------------------
def launch(config, args, out):
    sys.path.insert(0, HERE)
    from _launch import master_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSHIM_")}
    env.update(OMP_NUM_THREADS="1", LOCAL_SIZE=str(args.nproc))
    with master_port() as port:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(port), os.path.abspath(__file__),
               "--config", config, "--out", out] + [f"--{k}={getattr(args, k)}" for k in
                                                    ("layers", "width", "batch", "steps", "epochs", "workers")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"config": config, "error": (proc.stdout + proc.stderr)[-1500:]}
    ranks = [json.load(open(f"{out}.rank{r}")) for r in range(args.nproc)]
    return {"config": config, "ranks": ranks}


def summarise(run, epochs):
    """Per epoch: system used at the last step (GB), growth over the state
    after engine init, and the PSS of the rank trees summed (GB)."""
    rank0 = run["ranks"][0]
    rows = []
    for epoch in range(epochs):
        last = [s for s in rank0["samples"] if s["epoch"] == epoch][-1]
        first = [s for s in rank0["samples"] if s["epoch"] == epoch][0]
        pss = sum([s for s in r["samples"] if s["epoch"] == epoch][-1]["pss"] for r in run["ranks"])
        rows.append({"epoch": epoch + 1, "system_first": first["system"] / 1024, "system_last": last["system"] / 1024,
                     "growth": (last["system"] - rank0["after_init"]) / 1024, "pss_last": pss / 1024})
    return rows


def compare(args):
    import tempfile

    configs = args.configs.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            run = launch(config, args, os.path.join(tmp, config.replace("+", "_")))
            results.append(run)
            if "error" in run:
                print(f"{config}: FAILED\n{run['error']}", flush=True)
                continue
            rows = summarise(run, args.epochs)
            run["rows"] = rows
            print(f"{config}: " + "; ".join(
                f"epoch {r['epoch']}: system {r['system_first']:.2f} -> {r['system_last']:.2f} GB "
                f"(+{r['growth']:.2f} over init), PSS {r['pss_last']:.2f} GB" for r in rows), flush=True)
    ok = [r for r in results if "rows" in r]
    if not ok:
        return 1
    r0 = ok[0]["ranks"][0]
    print(f"\n{ok[0]['ranks'][0]['params'] / 1e6:.0f}M parameters, {r0['world']} ranks, {args.layers} x "
          f"Linear({args.width}, {args.width}), ZeRO-3 offload_optimizer+offload_param (cpu), bf16, "
          f"{args.epochs} epochs x {args.steps} steps, DataLoader workers {args.workers}")
    print("| config | system used, epoch 1 (GB) | epochs 2+ (GB) | growth over init, last epoch (GB) "
          "| PSS of the rank trees, last step (GB) | losses |")
    print("|---|---|---|---|---|---|")
    reference = ok[0]["ranks"][0]["losses"]
    for run in ok:
        rows = run["rows"]
        later = rows[1:] or rows
        same = "same as " + ok[0]["config"] if run["ranks"][0]["losses"] == reference else "DIFFERENT"
        print(f"| {run['config']} | {rows[0]['system_first']:.1f} → {rows[0]['system_last']:.1f} | "
              f"{min(r['system_first'] for r in later):.1f} → {max(r['system_last'] for r in later):.1f} | "
              f"{rows[-1]['growth']:.2f} | {rows[-1]['pss_last']:.2f} | {same} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", action="store_true", help="driver: run --configs and print the table")
    parser.add_argument("--configs", default="none,none+call,workers,workers+zeroshim,workers+nofork+call,"
                                             "persistent,persistent+zeroshim,forkserver")
    parser.add_argument("--config", default="workers")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", help="worker: write results to OUT.rank<R>")
    parser.add_argument("--json", help="driver: write every run's samples here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the test suite runs this)")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.width, args.steps, args.epochs, args.nproc = 2, 256, 2, 2, 1
        if args.compare and args.configs == parser.get_default("configs"):
            args.configs = "none,workers,workers+zeroshim"
    if args.compare:
        return compare(args)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
