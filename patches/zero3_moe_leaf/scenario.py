"""Scenario for patch ``zero3_moe_leaf``: two Mixture-of-Experts blocks whose
forward calls only the experts that got tokens (as transformers 4.52-4.57 and
remote-code MoE models do), under ZeRO-3 on 2 ranks.  One block's class is
named ``DeepseekV2MoE``, as remote-code DeepSeek-V2 names it (zeroshim knows it
by name); the other, ``CustomSparseMoe``, is in no list (zeroshim knows it by
its structure: a ``router`` with one output per expert and a ``ModuleList`` of
experts).  A third, transformers' own ``SwitchTransformersSparseMLP`` (experts
in a ``ModuleDict``; in transformers 5 a subclass whose own forward skips the
experts without tokens, in 4.x a loop over the experts hit), is also found by
structure.  Their routers are frozen so that rank 0's tokens go to expert 0 and
rank 1's to expert 1.

* ``reference``: the same blocks calling every expert, also those without
  tokens (the ranks' all-gathers pair up; the numbers any fix must reproduce);
  the Switch block, whose loop is transformers' own, marked a leaf by hand
  (``deepspeed.utils.set_z3_leaf_modules``, DeepSpeed's documented remedy);
* ``frozen``: the two blocks of ``reference`` behind a frozen input projection (as
  behind a frozen embedding under LoRA): the blocks' input needs no grad.
  Unmarked (``--mode without``) it trains; marked as a leaf, DeepSpeed
  0.13.2-0.17.x raises "A module cannot be set as a leaf module when it does
  not have any input tensors that require gradients ..." and 0.18+ reduces the
  blocks' gradients before they are computed (its backward hook then fires on
  the output's gradient): zeroshim must not turn this working run into either;
* ``run`` (``--mode without``): skipping empty experts without zeroshim: the
  ranks gather different experts and wait for each other; a watchdog records
  ``hang`` after ``--timeout`` seconds and ends the process (DeepSpeed
  releases that compare the ranks' module traces at the next step raise
  ``disagreement between rank0 and rank1`` instead: recorded as the error);
* ``--mode with``: the same three with zeroshim.
"""

import sys
import traceback

if "with" in sys.argv:
    import zeroshim  # noqa: F401

import torch
import torch.nn as nn

from common import (ds_config, end_hang_scenario, hang_args, import_deepspeed, init_distributed, versions,
                    watch_for_hang, write_results)

deepspeed = import_deepspeed()
WIDTH, EXPERTS, STEPS = 8, 4, 3


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def frozen_router():
    router = nn.Linear(WIDTH, EXPERTS, bias=False)
    with torch.no_grad():  # expert e <- input dimension e
        router.weight.zero_()
        router.weight[:, :EXPERTS] = torch.eye(EXPERTS)
    return router.requires_grad_(False)


def routed(x, route, experts, skip_empty):
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        rows = (route == e).nonzero().flatten()
        if skip_empty and rows.numel() == 0:
            continue  # what transformers 4.52+ and remote-code blocks do
        out = out.index_add(0, rows, expert(x[rows]))
    return out


class DeepseekV2MoE(nn.Module):
    """A block zeroshim knows by its class name."""

    def __init__(self, skip_empty: bool):
        super().__init__()
        self.gate = frozen_router()
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.skip_empty = skip_empty

    def forward(self, x):
        return routed(x, self.gate(x).argmax(-1), self.experts, self.skip_empty)


class CustomSparseMoe(nn.Module):
    """A block in no list: zeroshim knows it by its structure (router + ModuleList of experts)."""

    def __init__(self, skip_empty: bool):
        super().__init__()
        self.router = frozen_router()
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.skip_empty = skip_empty

    def forward(self, x):
        return routed(x, self.router(x).argmax(-1), self.experts, self.skip_empty)


def switch_block():
    """transformers' Switch Transformers block (4 experts, width 8, no jitter or dropout, room for every token),
    its router frozen like the others; None where the installed transformers has none."""
    try:
        from transformers.models.switch_transformers import modeling_switch_transformers as module
    except ImportError:
        return None
    block = module.SwitchTransformersSparseMLP(module.SwitchTransformersConfig(
        d_model=WIDTH, d_ff=2 * WIDTH, num_experts=EXPERTS, expert_capacity=64, router_jitter_noise=0.0,
        dropout_rate=0.0, router_dtype="bfloat16"))
    classifier = block.router.classifier
    with torch.no_grad():  # expert e <- input dimension e
        classifier.weight.zero_()
        classifier.weight[:, :EXPERTS] = torch.eye(EXPERTS)
    classifier.requires_grad_(False)
    return block


class Net(nn.Module):
    def __init__(self, skip_empty, frozen_input, switch=True):
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)  # the blocks' input requires grad, as after attention in a real model
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(WIDTH))
            self.proj.bias.zero_()
        self.proj.requires_grad_(not frozen_input)  # frozen: as behind a frozen embedding under LoRA
        self.moe = DeepseekV2MoE(skip_empty)
        self.custom = CustomSparseMoe(skip_empty)
        self.switch = switch_block() if switch else None
        self.head = nn.Linear(WIDTH, 1)
        self.input_required_grad = []

    def forward(self, x):
        h = self.proj(x)
        self.input_required_grad.append(h.requires_grad)
        out = h + self.moe(h) + self.custom(h)
        if self.switch is not None:
            y = self.switch(h[None])  # (batch, sequence, width); transformers 4.x also return the router's outputs
            out = out + (y[0] if isinstance(y, tuple) else y)[0]
        return self.head(out).float().pow(2).mean()


def train(skip_empty: bool, frozen_input: bool = False) -> dict:
    torch.manual_seed(0)
    net = Net(skip_empty, frozen_input, switch=not frozen_input)
    if not skip_empty and net.switch is not None:  # the reference: DeepSpeed's own remedy for transformers' loop
        from deepspeed.utils import set_z3_leaf_modules
        set_z3_leaf_modules(net, [type(net.switch)])
    params = [p for p in net.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(params, lr=1e-3),
                                      config=ds_config(3, micro_batch=2))
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(11 + rank)
    losses = []
    for _ in range(STEPS):
        x = 0.1 * torch.randn(2, WIDTH, generator=gen)
        x[:, rank] += 5.0  # this rank's tokens go to expert `rank`
        loss = engine(x.to(torch.bfloat16))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    leaves = sorted(type(m).__name__ for m in net.modules() if getattr(m, "_z3_leaf", False))
    return {"losses": losses, "leaves": leaves, "input_required_grad": any(net.input_required_grad)}


def main():
    args = hang_args()
    init_distributed()
    results = {"versions": versions(), "mode": args.mode}
    results["reference"] = train(skip_empty=False)
    try:  # DeepSpeed 0.13.2-0.17.x raise in the leaf's forward where its input needs no grad
        results["frozen"] = train(skip_empty=False, frozen_input=True)
    except Exception as exc:
        traceback.print_exc()
        results["frozen"] = {"error": f"{type(exc).__name__}: {exc}"}

    # written before the routed run too: on 8 ranks gloo aborts the processes inside it (a collective of
    # another size) before anything else is written, and the judge still needs the reference runs
    write_results(args.out, results)
    watch_for_hang(args, results, "run")
    try:
        results["run"] = train(skip_empty=True)
    except Exception as exc:  # DeepSpeed's trace check (reset_step) notices the ranks' differing modules
        results["run"] = {"error": f"{type(exc).__name__}: {exc}"}
    if "zeroshim" in sys.modules:
        results["stats"] = sys.modules["zeroshim"].stats("zero3_moe_leaf")
        results["status"] = sys.modules["zeroshim"].status()["zero3_moe_leaf"].as_dict()
    end_hang_scenario(args, results, peers_may_hang="error" in results["run"] or args.mode == "without")


if __name__ == "__main__":
    main()
