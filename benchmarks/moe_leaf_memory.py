"""What marking an MoE block as a ZeRO-3 leaf module costs in gathered parameters (patch zero3_moe_leaf).

A leaf module is gathered whole at its entry: all its experts at once, where
the unmarked block gathers one expert module at a time.  This measures the
peak number of parameter elements gathered (``ds_status`` AVAILABLE, counted
in full ``ds_numel``) during the forward and backward of one Mixtral-shaped
block (router ``Linear(hidden, experts)``, each expert a SwiGLU MLP of
``gate/up/down`` projections) in a ZeRO-3 engine on 1 rank (gloo, CPU, bf16,
``stage3_param_persistence_threshold: 0``), marked (``_z3_leaf = True``, what
zeroshim sets) and unmarked.  Both call every expert (the unmarked block then
cannot hang).  Samples are taken inside each expert's forward and backward
(an identity autograd function at its input and output) and at each module's
forward, so each point sees what DeepSpeed holds gathered there; the peak is
over ``--steps`` steps (DeepSpeed's prefetch follows the trace recorded in the
first).  Two settings: neither prefetch nor reuse (``stage3_prefetch_bucket_size``
and ``stage3_max_reuse_distance`` 0: what the block itself needs) and
DeepSpeed's defaults (a prefetch bucket of 5e7 elements, parameters used again
within 1e9 elements kept gathered), which for a block this small keep every
expert gathered anyway: the leaf's cost shows where one block's experts exceed
those sizes (Mixtral-8x7B: 8 x 176M elements per block).

    python benchmarks/moe_leaf_memory.py             # hidden 256, intermediate 512, 8 experts
    python benchmarks/moe_leaf_memory.py --smoke     # tiny sizes (the test suite)
"""

import argparse
import os


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.intermediate, args.experts, args.tokens, args.steps = 16, 32, 4, 8, 2

    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    from _launch import master_port

    with master_port() as port:
        os.environ.setdefault("MASTER_PORT", str(port))
        run(args)


def run(args):
    import deepspeed
    import torch
    import torch.nn as nn
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    deepspeed.init_distributed(dist_backend="gloo")
    hidden, inter, n_experts = args.hidden, args.intermediate, args.experts
    state = {"model": None, "peak": 0}

    def sample():
        gathered = sum(p.ds_numel for p in state["model"].parameters()
                       if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE)
        state["peak"] = max(state["peak"], gathered)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            sample()
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            sample()
            return grad

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
            self.down_proj = nn.Linear(inter, hidden, bias=False)

        def forward(self, x):
            x = Probe.apply(x)
            return Probe.apply(self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)))

    class SparseMoe(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(hidden, n_experts, bias=False)
            self.experts = nn.ModuleList(Expert() for _ in range(n_experts))

        def forward(self, x):
            weights, chosen = torch.topk(torch.softmax(self.gate(x).float(), -1), 2, dim=-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):  # every expert, also without tokens
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None].to(x.dtype))
            return out

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.moe, self.head = nn.Linear(hidden, hidden), SparseMoe(), nn.Linear(hidden, 1)

        def forward(self, x):
            h = self.proj(x)
            return self.head(h + self.moe(h)).float().pow(2).mean()

    expert_numel = 3 * hidden * inter
    print(f"block: hidden {hidden}, intermediate {inter}, {n_experts} experts of {expert_numel:,} elements "
          f"({n_experts * expert_numel:,} in all), {args.tokens} tokens, top-2, {args.steps} steps")
    print("| prefetch, reuse | unmarked: peak gathered | leaf: peak gathered | leaf / unmarked |")
    print("|---|---|---|---|")
    for bucket in (0, None):
        peaks = {}
        for leaf in (False, True):
            torch.manual_seed(0)
            net = Net()
            if leaf:
                net.moe._z3_leaf = True  # what zeroshim sets
            zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
            if bucket is not None:
                zero.update(stage3_prefetch_bucket_size=bucket, stage3_max_reuse_distance=bucket)
            config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
                      "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
            engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4),
                                              config=config)
            state["model"], state["peak"] = net, 0
            hooks = [m.register_forward_pre_hook(lambda *_: sample()) for m in net.modules()]
            gen = torch.Generator().manual_seed(1)
            for _ in range(args.steps):
                loss = engine(torch.randn(args.tokens, hidden, generator=gen).to(torch.bfloat16))
                engine.backward(loss)
                engine.step()
            for hook in hooks:
                hook.remove()
            peaks[leaf] = state["peak"]
            engine.destroy() if hasattr(engine, "destroy") else None
        label = "0, 0" if bucket == 0 else "DeepSpeed's defaults (5e7, 1e9)"
        print(f"| {label} | {peaks[False]:,} | {peaks[True]:,} | {peaks[True] / peaks[False]:.2f} |")


if __name__ == "__main__":
    main()
