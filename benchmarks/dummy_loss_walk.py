"""Cost of zero3_dummy_loss's graph walk against the backward it precedes.

``--model mlp`` (default): a 32-layer pre-norm transformer-style MLP stack
(hidden 512, batch 4 x seq 128) on the CPU: time ``strip_zero_terms(loss)``
(one walk of the whole graph) and ``loss.backward()``; median of N runs.  No
DeepSpeed: a graph without DeepSpeed's hooks and without the multiplications by
constants the walk inspects more closely.

``--model llama``: the realistic graph.  A 32-layer ``LlamaForCausalLM``
(hidden 256, 4 heads, vocab 1024, batch 2 x seq 128) built under
``deepspeed.zero.Init`` in a ZeRO-3 engine (1 rank, gloo,
``stage3_param_persistence_threshold: 0``, AdamW), non-reentrant activation
checkpointing on: DeepSpeed's module hooks are in the graph, and RMSNorm, the
rotary embedding and SwiGLU add multiplications by tensors that need no grad
(each one a candidate the walk examines).  zeroshim is restricted to
``zero3_dummy_loss``; the walk is timed inside the patched ``engine.backward``.
Two phases: (1) steps whose loss carries a dummy term
``0.0 * sum(p.sum() for p in model.parameters())`` (the patch must cut it); (2)
steps with the plain loss, ``zero3_dummy_loss`` on and off interleaved: what a
user without dummy terms pays per step.

    python benchmarks/dummy_loss_walk.py [--layers 32] [--runs 10] [--smoke]
    python benchmarks/dummy_loss_walk.py --model llama [--layers 32] [--runs 10] [--smoke]
    python benchmarks/dummy_loss_walk.py --device cuda --hidden 4096 --seq 2048 --dtype bf16
"""

import argparse
import os
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


def count_nodes(loss) -> int:
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return len(seen)


def spread(values):
    return f"median {statistics.median(values) * 1e3:9.2f} ms [{min(values) * 1e3:.2f}, {max(values) * 1e3:.2f}]"


def llama(args):
    """The realistic graph: see the module docstring."""
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    import zeroshim

    zeroshim.configure(only=["zero3_dummy_loss"])
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeroshim.patches import zero3_dummy_loss as patch

    hidden, seq, batch = (16, 8, 2) if args.smoke else (256, args.seq, 2)
    layers = 2 if args.smoke else args.layers
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(LlamaConfig(
            num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 43 // 16,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=1024, max_position_embeddings=2 * seq))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    walks = []
    real_walk = patch.strip_zero_terms

    def timed_walk(*args, **kwargs):  # what engine.backward's wrapper calls (loss, engine), timed
        start = time.perf_counter()
        try:
            return real_walk(*args, **kwargs)
        finally:
            walks.append(time.perf_counter() - start)

    patch.strip_zero_terms = timed_walk
    ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(1))
    params = list(engine.module.parameters())
    runs = 1 if args.smoke else args.runs

    def step(dummy: bool, count: bool = False):
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        if dummy:
            loss = loss + 0.0 * sum(p.sum() for p in params)
        nodes = count_nodes(loss) if count else None
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - start, nodes

    try:
        # (1) a dummy term in every loss: the walk finds and cuts it
        timings, cut_before = [], patch.stats["stripped"]
        nodes = step(True, count=True)[1]  # also the warm-up
        walks.clear()
        for _ in range(runs):
            timings.append(step(True)[0])
        cut = patch.stats["stripped"] - cut_before
        dummy_walks = list(walks)
        print(f"llama layers={layers} hidden={hidden} seq={seq} batch={batch} ZeRO-3 1 rank, non-reentrant "
              f"checkpointing, deepspeed {deepspeed.__version__}, torch {torch.__version__}, "
              f"threads={torch.get_num_threads()}, runs={runs}")
        print(f"graph: {nodes} autograd nodes with the dummy term; terms cut per step: {cut / (runs + 1):.0f}")
        print(f"phase 1 (dummy term) walk  {spread(dummy_walks)}")
        print(f"phase 1 (dummy term) step  {spread(timings)}")
        print(f"walk / step: {100 * statistics.median(dummy_walks) / statistics.median(timings):.3f} %")
        # (2) the plain loss; zero3_dummy_loss on and off, interleaved
        steps, walks[:] = {True: [], False: []}, []
        for i in range(2 * (runs + 1)):
            on = i % 2 == 0
            zeroshim.configure(zero3_dummy_loss="on" if on else "off")
            elapsed = step(False)[0]
            if i >= 2 or args.smoke:
                steps[on].append(elapsed)
        plain_walks = walks[1:] if len(walks) > 1 else walks
        on, off = statistics.median(steps[True]), statistics.median(steps[False])
        print(f"phase 2 (plain loss) walk  {spread(plain_walks)}")
        print(f"phase 2 step, patch on     {spread(steps[True])}")
        print(f"phase 2 step, patch off    {spread(steps[False])}")
        ratios = [a / b for a, b in zip(steps[True], steps[False])]
        print(f"step on/off: {on / off:.4f} (median of steps); pairwise ratios median "
              f"{statistics.median(ratios):.4f} [{min(ratios):.4f}, {max(ratios):.4f}]")
        print(f"walk / step (plain loss): {100 * statistics.median(plain_walks) / off:.3f} %")
    finally:
        patch.strip_zero_terms = real_walk
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["mlp", "llama"], default="mlp")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one run (keeps the script from rotting)")
    args = parser.parse_args()
    if args.model == "llama":
        return llama(args)
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
