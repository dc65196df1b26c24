"""Cost of zero3_dummy_loss's graph walk against the backward it precedes.

A 32-layer pre-norm transformer-style MLP stack (hidden 512, batch 4 x seq 128)
on the CPU: time ``strip_zero_terms(loss)`` (one walk of the whole graph) and
``loss.backward()``; median of N runs.  No DeepSpeed needed: the walk is the
same code, and it visits every node whether or not parameters are partitioned.

    python benchmarks/dummy_loss_walk.py [--layers 32] [--runs 10] [--smoke]
    python benchmarks/dummy_loss_walk.py --device cuda --hidden 4096 --seq 2048 --dtype bf16
"""

import argparse
import statistics
import time

import torch
import torch.nn as nn

from zeroshim.patches.zero3_dummy_loss import strip_zero_terms


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn_proj = nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn_proj(self.norm1(x))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one run (keeps the script from rotting)")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.runs = 2, 16, 1
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = nn.Sequential(*[Block(args.hidden) for _ in range(args.layers)]).to(args.device, dtype)
    batch = 1 if args.device == "cuda" else 4
    x = torch.randn(batch, args.seq if not args.smoke else 4, args.hidden, device=args.device, dtype=dtype)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    walks, backwards = [], []
    for i in range(args.runs + 2):
        loss = model(x).float().pow(2).mean()
        sync()
        start = time.perf_counter()
        strip_zero_terms(loss)
        walk = time.perf_counter() - start
        start = time.perf_counter()
        loss.backward()
        sync()
        if i >= 2 or args.smoke:  # two warm-up iterations
            walks.append(walk)
            backwards.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    # End to end, as in training: no sync between forward, walk and backward;
    # iterations with and without the walk interleaved.
    steps = {True: [], False: []}
    for i in range(2 * (args.runs + 2)):
        with_walk = i % 2 == 0
        sync()
        start = time.perf_counter()
        loss = model(x).float().pow(2).mean()
        if with_walk:
            strip_zero_terms(loss)
        loss.backward()
        sync()
        if i >= 4 or args.smoke:
            steps[with_walk].append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    walk, backward = statistics.median(walks), statistics.median(backwards)
    print(f"device={args.device} dtype={args.dtype} layers={args.layers} hidden={args.hidden} seq={args.seq} "
          f"threads={torch.get_num_threads()} runs={len(walks)}")
    print(f"graph walk  median {walk * 1e3:8.3f} ms")
    print(f"backward    median {backward * 1e3:8.3f} ms")
    print(f"walk / backward: {100 * walk / backward:.3f} %  (host time of the walk, synchronised)")
    on, off = statistics.median(steps[True]), statistics.median(steps[False])
    print(f"forward+backward median: {off * 1e3:.3f} ms without the walk, {on * 1e3:.3f} ms with it: "
          f"{100 * (on - off) / off:+.2f} % (interleaved, unsynchronised as in training)")


if __name__ == "__main__":
    main()
