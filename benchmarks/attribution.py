"""zeroshim's own time per training step, attributed directly (issue #28 item 3).

On a shared 2-core machine the step-time ratio with/without zeroshim spreads by
5-10 %, too much to resolve 1 %.  Here zeroshim runs in its benchmark mode
(``ZEROSHIM_TIMING=1``, zeroshim/_timing.py): every wrapper a patch installs is
timed and the time inside the function it wraps is subtracted, so what is left is
zeroshim's own time, per patch.  Reported as a share of the step's wall time, per
rank (the largest share over the ranks is the row's figure).

    python benchmarks/attribution.py                 # table: 1 and 4 ranks, each workload (a few minutes)
    python benchmarks/attribution.py --smoke         # seconds; used by the test suite so this cannot rot

Workloads (fp32: this CPU has no bf16 kernels, and emulated bf16 steps would hide zeroshim's
share; gloo, CPU, an 8-block MLP of width ``--hidden`` on 8 x 64 tokens):

* ``zero2``, ``zero3``: nothing a patch changes (no checkpointing, no dummy
  term): the wrappers' own cost (engine tracking, ZeRO-3's backward graph walk
  that finds nothing to cut);
* ``zero3-acting``: every block under reentrant ``torch.utils.checkpoint``
  (``nonreentrant_checkpoint`` converts each call) and a zero-weighted term over
  an unused partitioned layer (``zero3_dummy_loss`` walks and cuts it every step).

``--model llama`` (issue #47 item 8) replaces the MLP by a Llama decoder of the 7B
shape's depth at a tiny width (``transformers.LlamaForCausalLM``, 32 layers of width
``--hidden``, vocabulary 256, 8 x 64 tokens): the autograd graph and the parameter
count per layer of a real model (9 tensors a layer, about 80 autograd nodes), so the
costs that scale with nodes and parameters (the backward-graph walk, the
per-parameter gradient hooks) are counted at real size; only ``zero2`` and ``zero3``.

Not attributed: hooks patches register on torch objects (see zeroshim/_timing.py).
The timers' own cost (one to two microseconds per wrapped call) is counted as
zeroshim's, so the shares are upper bounds; the last column subtracts it, measured
after the steps on wrappers that do nothing (``_timing.bias``).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _launch import master_port

WORKLOADS = ("zero2", "zero3", "zero3-acting")


def worker(args):
    import zeroshim  # ZEROSHIM_TIMING=1 is in the environment
    from zeroshim import _timing

    assert _timing.ENABLED, "ZEROSHIM_TIMING=1 did not reach the worker"
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    acting = args.workload == "zero3-acting"
    stage = 2 if args.workload == "zero2" else 3
    h = args.hidden

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
                                        for _ in range(args.layers))
            self.unused = nn.Linear(h, h)  # reached only by the zero-weighted term

        def forward(self, x):
            for block in self.blocks:
                x = x + (checkpoint(block, x, use_reentrant=True) if acting else block(x))
            loss = x.pow(2).mean()
            if acting:
                loss = loss + 0.0 * self.unused.weight.sum()
            return loss

    torch.manual_seed(0)
    if args.model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=h, intermediate_size=int(h * 8 / 3), num_hidden_layers=args.layers,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.llama = llama

            def forward(self, ids):
                return self.llama(input_ids=ids, labels=ids).loss

    net = Net()
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4),
                                      config=config)
    gen = torch.Generator().manual_seed(rank)
    if args.model == "llama":
        x = torch.randint(0, 256, (8, 64), generator=gen)
    else:
        x = torch.randn(8, 64, h, generator=gen).requires_grad_(acting)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            _timing.reset()
            start = time.perf_counter()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
    wall = time.perf_counter() - start
    own = _timing.report()
    bias = _timing.bias()  # the timers' own time per call, counted in `own`
    stats = {name: zeroshim.stats(name) for name in ("zero3_dummy_loss", "nonreentrant_checkpoint")}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:  # (stdout lines of ranks interleave)
        json.dump({"rank": rank, "step_s": wall / args.steps, "own": own, "bias": bias,
                   "own_s_per_step": sum(v["seconds"] for v in own.values()) / args.steps, "stats": stats}, fh)
    dist.barrier()
    dist.destroy_process_group()


def less_bias(entry, bias) -> float:
    """A patch's own seconds less the timers' own time in its calls (``_timing.bias``, measured in a tight loop
    after the steps: where the timers cost more inside the run, some of their time stays in), without wrapt's
    dispatch, which no timer sees (``benchmarks/per_call.py`` measures it)."""
    wrappers = entry["calls"] - entry["function_calls"]
    return max(0.0, entry["seconds"] - wrappers * bias["wrapper"] - entry["function_calls"] * bias["function"])


def measure(args, workload, nproc):
    env = dict(os.environ, ZEROSHIM_TIMING="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="",
               LOCAL_SIZE=str(nproc), PYTHONWARNINGS="ignore")
    with master_port() as port, tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(port), __file__, "--worker", "--workload", workload,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--model", args.model, "--out", out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(nproc)
                 if os.path.exists(os.path.join(out, f"rank{r}.json"))]
    if len(ranks) != nproc:
        raise SystemExit(f"{workload} on {nproc} rank(s) failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-3000:]}")
    shares = [r["own_s_per_step"] / r["step_s"] for r in ranks]
    worst = max(range(nproc), key=lambda i: shares[i])
    return {"workload": workload, "ranks": nproc, "step_ms": ranks[worst]["step_s"] * 1000,
            "own_ms": ranks[worst]["own_s_per_step"] * 1000, "share": shares[worst],
            "per_patch_ms": {k: v["seconds"] / args.steps * 1000 for k, v in ranks[worst]["own"].items()},
            "per_patch_calls": {k: v["calls"] / args.steps for k, v in ranks[worst]["own"].items()},
            "per_patch_ms_less_bias": {k: less_bias(v, ranks[worst]["bias"]) / args.steps * 1000
                                       for k, v in ranks[worst]["own"].items()},
            "bias_us": {k: v * 1e6 for k, v in ranks[worst]["bias"].items()},
            "stats": ranks[worst]["stats"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--workload", choices=WORKLOADS, default="zero3")
    parser.add_argument("--ranks", default="1,4")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, help="default 128 (mlp), 64 (llama)")
    parser.add_argument("--layers", type=int, help="default 8 (mlp), 32 (llama)")
    parser.add_argument("--model", choices=("mlp", "llama"), default="mlp",
                        help="llama: a 32-layer Llama decoder at width --hidden (default 64), zero2 and zero3")
    parser.add_argument("--workloads", help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all; llama: "
                        "zero2,zero3)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--out", help=argparse.SUPPRESS)  # the worker's results folder
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    llama = args.model == "llama"
    if args.layers is None:
        args.layers = 32 if llama else 8
    if args.hidden is None:
        args.hidden = 64 if llama else 128
    if args.smoke:
        args.steps, args.warmup, args.layers, args.hidden, args.ranks = 2, 1, 2, 32, "1"
    workloads = args.workloads.split(",") if args.workloads else (("zero2", "zero3") if llama else WORKLOADS)
    bad = [w for w in workloads if w not in WORKLOADS or (llama and w == "zero3-acting")]
    if bad:
        parser.error(f"--workloads {','.join(bad)}: not a workload of --model {args.model}")
    rows = [measure(args, w, int(n)) for n in args.ranks.split(",") for w in workloads]
    print(f"zeroshim's own time per step (ZEROSHIM_TIMING=1; {args.model}, hidden {args.hidden}, {args.layers} "
          f"{'layers' if llama else 'blocks'}, "
          f"{args.steps} steps after {args.warmup}; the rank with the largest share)")
    print("| workload | ranks | step ms | zeroshim ms | share | by patch (ms/step) | less the timers' bias, ms "
          "(by patch) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        by = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["per_patch_ms"].items(), key=lambda kv: -kv[1]) if v)
        less = r["per_patch_ms_less_bias"]
        by_less = ", ".join(f"{k} {v:.3f}" for k, v in sorted(less.items(), key=lambda kv: -kv[1]) if v)
        print(f"| {r['workload']} | {r['ranks']} | {r['step_ms']:.1f} | {r['own_ms']:.3f} | {100 * r['share']:.2f} % "
              f"| {by} | {sum(less.values()):.3f} ({by_less}) |")
    bias = rows[0]["bias_us"] if rows else {}
    print(f"(the timers' own time a call, subtracted in the last column: {bias.get('wrapper', 0):.2f} µs a wrapper, "
          f"{bias.get('function', 0):.2f} µs a replacement; measured after the steps, on wrappers that do nothing)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "args": vars(args)}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
