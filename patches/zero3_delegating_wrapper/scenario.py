"""Scenario for patch ``zero3_delegating_wrapper``: peft LoRA on ``fc1`` with
``modules_to_save=["head"]`` (peft wraps the head in ``ModulesToSaveWrapper``,
whose ``__getattr__`` delegates to the wrapped copy), ZeRO-3, 3 steps.

* ``reference``: the same LoRA model with the head made trainable directly (no
  wrapper): what the wrapped run must reproduce;
* ``without``: no zeroshim (DeepSpeed 0.16.5 - 0.19.2: AttributeError
  ``ds_grads_remaining`` at the first forward);
* ``with``: zeroshim.

Each records the losses and a digest of the trainable parameters' shards, in
order (LoRA A, LoRA B, head weight, head bias in both models).
"""

import hashlib

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, train_small

deepspeed = import_deepspeed()
STEPS = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.act(self.fc1(x))).float().pow(2).mean()


def trainable_digest(engine) -> str:
    digest = hashlib.sha256()
    rank = torch.distributed.get_rank()
    for p in engine.module.parameters():
        if not p.requires_grad:
            continue
        shard = p.ds_tensor.flatten()
        valid = max(0, min(shard.numel(), p.ds_numel - rank * shard.numel()))
        digest.update(shard[:valid].detach().float().numpy().tobytes())
    return digest.hexdigest()


def train(wrapped: bool) -> dict:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = Net()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["fc1"], modules_to_save=["head"] if wrapped else None)
    model = get_peft_model(net, config)
    if not wrapped:
        model.base_model.model.head.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2),
                                      config=ds_config(3, micro_batch=2))
    losses = train_small(engine, STEPS)
    wrappers = [type(m).__name__ for m in model.modules() if type(m).__name__ == "ModulesToSaveWrapper"]
    return {"losses": losses, "trainable_sha256": trainable_digest(engine), "wrappers": wrappers}


def main():
    out, results = begin()
    results["reference"] = attempt(train, False)
    results["without"] = attempt(train, True)
    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero3_delegating_wrapper"].as_dict()
    results["with"] = attempt(train, True)
    results["refused"] = zeroshim.stats("zero3_delegating_wrapper")["delegated_lookups_refused"]
    end(out, results)


if __name__ == "__main__":
    main()
