"""Scenario for patch ``loss_without_grad``: LoRA-shaped training with reentrant activation
checkpointing whose block inputs do not require grad (the case ``nox -s differential``
found failing both ways).  A frozen embedding, 2 blocks (a frozen 32x32 linear plus a
trainable rank-4 adapter, each block run through ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=True)``), a frozen head; AdamW, fp32, 2 steps, ZeRO-2 and ZeRO-3, inputs
drawn per rank.

Runs, in one process per rank (``z{stage}/{run}``):

* ``without``: no zeroshim: DeepSpeed's own error (0.19: "loss must be a scalar tensor";
  older: torch's "element 0 of tensors does not require grad");
* ``remedy/without``: the same with the embedding's output made to require grad (what
  ``enable_input_require_grads`` does), no zeroshim: trains -- the reference;
* ``detached/without``: the remedy's model with its loss detached by hand, no zeroshim
  (another cause: here checkpointing is not to blame);
* ``with``, ``remedy/with``, ``detached/with``: the same with zeroshim (its error names the
  cause; the remedy trains to the reference's numbers bit for bit).
"""

import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
VOCAB, WIDTH, RANK, SEQ, MICRO, STEPS = 64, 32, 4, 8, 2, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.lora_a = nn.Linear(WIDTH, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, WIDTH, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.lora_b(self.lora_a(x)))


class Model(nn.Module):
    def __init__(self, input_grads: bool, detach: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.embed.requires_grad_(False)
        self.head.requires_grad_(False)
        self.input_grads, self.detach = input_grads, detach

    def forward(self, ids):
        h = self.embed(ids)
        if self.input_grads:
            h.requires_grad_(True)  # what model.enable_input_require_grads() does with a forward hook
        for block in self.blocks:
            h = cp.checkpoint(block, h, use_reentrant=True)
        loss = nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())
        return loss.detach() if self.detach else loss


def train(stage: int, input_grads: bool = False, detach: bool = False) -> dict:
    torch.manual_seed(0)
    model = Model(input_grads, detach)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2),
                                      config=ds_config(stage, micro_batch=MICRO, bf16=False))
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = engine(torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, **param_digest(engine)}


def runs(tag: str) -> dict:
    out = {}
    for stage in (2, 3):
        out[f"z{stage}/{tag}"] = attempt(train, stage)
        out[f"z{stage}/remedy/{tag}"] = attempt(train, stage, input_grads=True)
        out[f"z{stage}/detached/{tag}"] = attempt(train, stage, input_grads=True, detach=True)
    return out


def main():
    out, results = begin()
    results.update(runs("without"))
    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()["loss_without_grad"].as_dict()
    results.update(runs("with"))
    results["raised"] = zeroshim.stats("loss_without_grad")["raised"]
    end(out, results)


if __name__ == "__main__":
    main()
