"""Scenario for patch ``zero_moe_skipped_experts``: per-expert MoE blocks under ZeRO-1 and ZeRO-2 on 2 ranks, each
rank routing its tokens to its own expert.

The model sums, after an identity projection, the outputs of every MoE block the installed transformers has of the
three forms the patch rewrites (each built from its own config class, 4 experts, top-1): ``Qwen3MoeSparseMoeBlock``
(``expert_hit``), ``JambaSparseMoeBlock`` (``continue`` on an empty slice), ``DeepseekV3MoE`` (``if ...numel() >
0``) and ``DeepseekV2MoE`` (``continue`` where a token count is 0), transformers 5's
``SwitchTransformersSparseMLP`` (its experts a ``ModuleDict`` subclass whose own forward has the ``expert_hit``
loop: ``SwitchTransformersExperts``, the form of NLLB-MoE too), and of one block written here as remote code
writes it (``RemoteMoe``, the ``expert_hit`` loop; the bug on every transformers, 5.x included, whose own blocks
fuse their experts).  The routers are frozen and set so that
expert ``e`` takes the tokens whose input dimension ``e`` is largest: rank 0's tokens go to expert 0, rank 1's to
expert 1, experts 2 and 3 get none on either rank.  fp32, client SGD, 3 steps.

Runs, in one process per rank:

* ``reference``: ZeRO stage 0 (DeepSpeed fills the missing gradients with zeros before its all-reduce: the average
  over the ranks);
* ``without/zero1``, ``without/zero2``: no zeroshim.  Both ranks reduce buckets of equal size, with expert 0's
  gradient at the offsets where the other rank has expert 1's: summed, silently;
* ``with/zero1``, ``with/zero2``: the same with zeroshim;
* ``same/without``, ``same/with``: ZeRO-2, both ranks routing to expert 0 (no rank disagrees; experts 1-3 un-hit
  everywhere): nothing to fix, the two must be equal bit for bit;
* ``with/zero0``: ZeRO-0 with zeroshim: nothing marked, the reference's numbers.

``natural/reference``, ``natural/with``: transformers' own Qwen3-MoE causal LM routing on its own, ZeRO-0 without
zeroshim and ZeRO-2 with it (where transformers has it, 4.51+).

``--split``: only a ZeRO-2 run with zeroshim where rank 1 cannot read one block's source: every rank must stop
before training, naming the ranks that read the blocks differently.

Each run records its losses and a digest of the parameters, the blocks built (and why a block the installed
transformers lacks was not), and, with zeroshim, the blocks it runs without the skip (``marked``).  Without zeroshim,
DeepSpeed's default (``reduce_scatter``) makes the two ranks' reductions differ in size here (gloo aborts: "1988 vs
1132 ... Is there a distributed collective mismatch"; benchmarks/RESULTS.md section 45); the runs without zeroshim
all-reduce whole buckets (``"reduce_scatter": false``), where the sizes match and the result is silently wrong.  With
zeroshim both configurations run (``with/zeroN`` and ``with/zeroN/default``).
"""

import sys

import torch
import torch.nn as nn

from common import (attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, init_distributed,
                    param_digest, write_results)

deepspeed = import_deepspeed()
NAME = "zero_moe_skipped_experts"
WIDTH, EXPERTS, TOKENS, STEPS, LR = 8, 4, 4, 3, 0.01


class RemoteMoe(nn.Module):
    """A block as remote code writes it (the transformers 4.52-4.57 loop over ``expert_hit``)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.SiLU(), nn.Linear(2 * WIDTH, WIDTH))
                                     for _ in range(EXPERTS))

    def forward(self, hidden_states):
        flat = hidden_states.reshape(-1, WIDTH)
        selected = self.gate(flat).argmax(-1, keepdim=True)
        out = torch.zeros_like(flat)
        expert_mask = torch.nn.functional.one_hot(selected, num_classes=EXPERTS).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            _, rows = torch.where(expert_mask[expert_idx].squeeze(0))
            out.index_add_(0, rows, self.experts[expert_idx](flat[rows]))
        return out.reshape(hidden_states.shape)


def _transformers_blocks() -> dict:
    """name -> a factory of the installed transformers' block (4 experts, top-1, width 8), for those it has."""
    def qwen3():
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeSparseMoeBlock
        return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=WIDTH, moe_intermediate_size=WIDTH,
                                                     num_experts=EXPERTS, num_experts_per_tok=1))

    def jamba():
        from transformers.models.jamba.modeling_jamba import JambaConfig, JambaSparseMoeBlock
        return JambaSparseMoeBlock(JambaConfig(hidden_size=WIDTH, intermediate_size=WIDTH, num_experts=EXPERTS,
                                               num_experts_per_tok=1))

    def deepseek_v3():
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE
        return DeepseekV3MoE(DeepseekV3Config(hidden_size=WIDTH, moe_intermediate_size=WIDTH,
                                              n_routed_experts=EXPERTS, num_experts_per_tok=1, n_group=1,
                                              topk_group=1, n_shared_experts=1, routed_scaling_factor=1.0))

    def deepseek_v2():
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Config, DeepseekV2MoE
        return DeepseekV2MoE(DeepseekV2Config(hidden_size=WIDTH, moe_intermediate_size=WIDTH,
                                              n_routed_experts=EXPERTS, num_experts_per_tok=1, n_group=1,
                                              topk_group=1, n_shared_experts=1, routed_scaling_factor=1.0))

    def switch():
        from transformers.models.switch_transformers import modeling_switch_transformers as module
        if not hasattr(module, "SwitchTransformersExperts"):  # 4.x: a loop over a selection the patch refuses
            raise RuntimeError("no SwitchTransformersExperts (transformers 4.x)")
        return module.SwitchTransformersSparseMLP(module.SwitchTransformersConfig(
            d_model=WIDTH, d_ff=WIDTH, num_experts=EXPERTS, expert_capacity=64, router_jitter_noise=0.0,
            dropout_rate=0.0))

    return {"Qwen3MoeSparseMoeBlock": qwen3, "JambaSparseMoeBlock": jamba, "DeepseekV3MoE": deepseek_v3,
            "DeepseekV2MoE": deepseek_v2, "SwitchTransformersSparseMLP": switch}


def _force_routing(block) -> None:
    """Freeze the router and set it so that expert e scores input dimension e (top-1: the largest)."""
    for child in ("gate", "router"):
        router = getattr(block, child, None)
        if not isinstance(router, nn.Module):
            continue
        for param in router.parameters():
            if param.dim() == 2 and param.shape == (EXPERTS, WIDTH):
                with torch.no_grad():
                    param.zero_()
                    param[:, :EXPERTS] = torch.eye(EXPERTS)
        router.requires_grad_(False)
        return
    raise RuntimeError(f"{type(block).__name__}: no router found")


class Net(nn.Module):
    def __init__(self, blocks: dict):
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)  # the blocks' input requires grad, as after attention
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(WIDTH))
            self.proj.bias.zero_()
        self.blocks = nn.ModuleDict(blocks)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = self.proj(x)
        out = h
        for block in self.blocks.values():
            y = block(h)
            out = out + (y[0] if isinstance(y, tuple) else y)
        return self.head(out).pow(2).mean()


def build(built: dict) -> Net:
    torch.manual_seed(0)
    blocks = {}
    for name, factory in _transformers_blocks().items():
        try:
            blocks[name] = factory()
        except Exception as exc:  # this transformers has no such block (or another signature)
            built[name] = f"{type(exc).__name__}: {exc}"
            continue
        built[name] = "built"
    blocks["RemoteMoe"] = RemoteMoe()
    built["RemoteMoe"] = "built"
    gen = torch.Generator().manual_seed(1)
    for block in blocks.values():
        with torch.no_grad():  # transformers 5 leaves fused experts' weights uninitialised outside from_pretrained
            for param in block.parameters():
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
        _force_routing(block)
    return Net(blocks)


def train(stage: int, route: str, reduce_scatter: bool = True) -> dict:
    built = {}
    net = build(built)
    params = [p for p in net.parameters() if p.requires_grad]
    config = ds_config(stage, micro_batch=1, bf16=False, **({} if reduce_scatter else {"reduce_scatter": False}))
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(params, lr=LR), config=config)
    rank = torch.distributed.get_rank()
    expert = rank if route == "own" else 0
    gen = torch.Generator().manual_seed(11 + rank)
    losses = []
    for _ in range(STEPS):
        x = 0.1 * torch.randn(1, TOKENS, WIDTH, generator=gen)
        x[..., expert] += 5.0
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "blocks": built, "marked": _marked_in(net), **param_digest(engine)}


def _marked_in(model) -> list:
    """With zeroshim: the class names of the blocks whose methods run without the skip."""
    if "zeroshim" not in sys.modules:
        return []
    from zeroshim.patches.zero_moe_skipped_experts import _marked
    return sorted(type(m).__name__ for m in model.modules() if m in _marked)


def natural(stage: int) -> dict:
    """transformers' own tiny Qwen3-MoE causal LM (2 layers, 8 experts, top-2), routing left to its router: 3 tokens a
    rank leave experts un-hit, on each rank others.  Without zeroshim ZeRO-1/2 abort here (gloo: "26304 vs 23232
    ... collective mismatch", benchmarks/RESULTS.md section 45), so the scenario runs it with zeroshim only."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=64))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                      config=ds_config(stage, micro_batch=1, bf16=False))
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (1, 3), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "marked": _marked_in(model), **param_digest(engine)}


def split() -> None:
    """``--split``: with zeroshim, rank 1 cannot read ``RemoteMoe.forward``'s source (as a node whose install
    ships no source, or other model code): the ranks read the blocks differently, and every rank must stop
    before its engine is built, naming the ranks."""
    import inspect

    out = sys.argv[sys.argv.index("--out") + 1]
    init_distributed()
    enable_zeroshim()
    if torch.distributed.get_rank() == 1:
        read = inspect.getsourcelines

        def unreadable(obj):
            if getattr(obj, "__qualname__", "") == "RemoteMoe.forward":
                raise OSError("could not get source code")
            return read(obj)
        inspect.getsourcelines = unreadable
    results = {"split": attempt(train, 2, "own")}
    end(out, results)


def main():
    if "--split" in sys.argv:
        return split()
    out, results = begin()
    results["reference"] = attempt(train, 0, "own")
    results["natural/reference"] = attempt(natural, 0)
    results["same/without"] = attempt(train, 2, "same")
    for stage in (1, 2):  # the reductions' sizes match: silently wrong
        results[f"without/zero{stage}"] = attempt(train, stage, "own", reduce_scatter=False)
    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()[NAME].as_dict()
    results["same/with"] = attempt(train, 2, "same")
    results["with/zero0"] = attempt(train, 0, "own")  # ZeRO-0 zero-fills missing gradients itself: nothing marked
    results["natural/with"] = attempt(natural, 2)
    for stage in (1, 2):
        results[f"with/zero{stage}"] = attempt(train, stage, "own", reduce_scatter=False)
        # DeepSpeed's default: without zeroshim the ranks' reductions differ in size here (gloo aborts the process)
        results[f"with/zero{stage}/default"] = attempt(train, stage, "own")
    results["stats"] = zeroshim.stats(NAME)
    end(out, results)


if __name__ == "__main__":
    main()
