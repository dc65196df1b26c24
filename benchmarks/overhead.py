"""What importing zeroshim costs: import time, and per-step time where no patch changes behaviour.

    python benchmarks/overhead.py                 # prints a table (about 5 minutes on 2 CPU cores)
    python benchmarks/overhead.py --smoke         # seconds; used by the test suite so this cannot rot

1. Import: wall time of ``python -c "import zeroshim"`` against ``python -c pass``
   (median of ``--runs``, interleaved), and zeroshim's cumulative time from
   ``python -X importtime``.
2. Per step: a 1-rank DeepSpeed run (gloo, CPU, bf16) of ZeRO-2 and ZeRO-3,
   with and without ``import zeroshim``, in separate processes, interleaved
   (``--pairs``); steps/s after warm-up, and the ratio's spread over the pairs.
   Nothing in these runs is something a patch changes (no checkpointing, no
   dummy loss, one epoch), so what is measured is the wrappers' own cost
   (engine tracking, the ZeRO-3 backward graph walk of zero3_dummy_loss).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _launch import master_port


def run(cmd, env=None):
    return subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)


def import_cost(runs):
    base, shim = [], []
    for _ in range(runs):
        for target, code in ((base, "pass"), (shim, "import zeroshim")):
            start = time.perf_counter()
            run([sys.executable, "-c", code])
            target.append(time.perf_counter() - start)
    cumulative = []
    for _ in range(runs):
        err = run([sys.executable, "-X", "importtime", "-c", "import zeroshim"]).stderr
        line = [x for x in err.splitlines() if x.rstrip().endswith("| zeroshim")][-1]
        cumulative.append(int(line.split("|")[1]) / 1000)
    return {"python_ms": statistics.median(base) * 1000, "import_zeroshim_ms": statistics.median(shim) * 1000,
            "added_ms": (statistics.median(shim) - statistics.median(base)) * 1000,
            "importtime_cumulative_ms": statistics.median(cumulative)}


def worker(args):
    if args.zeroshim:
        import zeroshim  # noqa: F401
    import torch
    import torch.nn as nn

    import deepspeed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    h = args.hidden
    model = nn.Sequential(*[nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
                            for _ in range(args.layers)])
    config = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=config)
    x = torch.randn(8, 64, h).to(torch.bfloat16)
    losses = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start, cpu_start = time.perf_counter(), time.process_time()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    # CPU time of the process: what zeroshim's Python adds shows up there too, and
    # it is less disturbed than wall time by other load on a shared machine.
    print(json.dumps({"steps_per_s": args.steps / elapsed, "cpu_steps_per_s": args.steps / cpu, "losses": losses}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # before interpreter exit (zeroshim/scenarios/common.py: finish)


def step_overhead(args):
    rows = {}
    for stage in (2, 3):
        ratios, cpu_ratios, rates = [], [], {"without": [], "with": []}
        for pair in range(args.pairs):
            out = {}
            order = ("without", "with") if pair % 2 == 0 else ("with", "without")
            for mode in order:
                env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
                with master_port() as port:
                    cmd = [sys.executable, __file__, "--worker", "--stage", str(stage), "--steps", str(args.steps),
                           "--warmup", str(args.warmup), "--hidden", str(args.hidden), "--layers",
                           str(args.layers), "--port", str(port)]
                    if mode == "with":
                        cmd.append("--zeroshim")
                    lines = [x for x in run(cmd, env).stdout.splitlines() if x.startswith("{")]
                out[mode] = json.loads(lines[-1])
                rates[mode].append(out[mode]["steps_per_s"])
            assert out["with"]["losses"] == out["without"]["losses"], "zeroshim changed the losses"
            ratios.append(out["with"]["steps_per_s"] / out["without"]["steps_per_s"])
            cpu_ratios.append(out["with"]["cpu_steps_per_s"] / out["without"]["cpu_steps_per_s"])
        rows[stage] = {"without_steps_per_s": statistics.median(rates["without"]),
                       "with_steps_per_s": statistics.median(rates["with"]),
                       "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                       "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratio_min": min(cpu_ratios),
                       "cpu_ratio_max": max(cpu_ratios)}
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--zeroshim", action="store_true")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--port", type=int, default=29700)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.steps, args.warmup, args.pairs, args.runs, args.layers = 2, 1, 1, 2, 1
    imp = import_cost(args.runs)
    steps = step_overhead(args)
    print(f"import (median of {args.runs}): python -c pass {imp['python_ms']:.1f} ms, "
          f"import zeroshim {imp['import_zeroshim_ms']:.1f} ms, added {imp['added_ms']:.1f} ms; "
          f"-X importtime cumulative {imp['importtime_cumulative_ms']:.1f} ms")
    print(f"per step (1 rank, hidden {args.hidden}, {args.layers} blocks, {args.steps} steps, {args.pairs} "
          "interleaved pairs; losses identical in every pair)")
    print("stage | steps/s without | steps/s with | with/without median [min, max] | same, CPU time")
    for stage, row in steps.items():
        print(f"ZeRO-{stage} | {row['without_steps_per_s']:15.2f} | {row['with_steps_per_s']:12.2f} | "
              f"{row['ratio_median']:.3f} [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}] | "
              f"{row['cpu_ratio_median']:.3f} [{row['cpu_ratio_min']:.3f}, {row['cpu_ratio_max']:.3f}]")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"import": imp, "steps": steps, "args": vars(args)}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
