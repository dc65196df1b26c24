"""Scenario for patch ``zero3_mixed_dtype_gather``: the report's shape (DeepSpeed #8072) on 2 CPU ranks.
A tiny model built under ``deepspeed.zero.Init`` with bf16 on (its parameters are bf16 shards), peft
LoRA on ``fc1`` and ``fc2`` with peft's default ``autocast_adapter_dtype=True`` (the adapters become
fp32 ZeRO parameters when the engine is built), ZeRO-3 + bf16, 3 steps.

* ``reference``: ``stage3_param_persistence_threshold: 0`` -- no parameter persists, so the step
  ends without the blocking gather of the persistent parameters (the path of the bug);
* ``without``: no zeroshim, DeepSpeed's default threshold (every parameter of this model persists):
  on DeepSpeed 0.19.2 the first ``step()`` fails in ``_post_step`` (on gloo: ``ProcessGroupGloo::allgather:
  invalid tensor type``; on NCCL the report's ``output tensor must have the same type as input tensor``);
* ``with``: zeroshim, the same run as ``without``;
* ``alone``: zeroshim with this patch alone (``zero3_gloo_gather``, which on gloo gathers one
  parameter at a time and so also avoids the mixed buffer, off): must train.

Each records the losses, the dtypes of the trainable shards and a digest of the shards (``param_digest``).
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest, train_small

NAME = "zero3_mixed_dtype_gather"
# no zeroshim at all in the runs without it: zero3_gloo_gather (gloo, < 0.19.8) gathers one parameter at a
# time and would hide this bug on CPU
deepspeed = import_deepspeed()
STEPS = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        gelu = torch.nn.functional.gelu
        return self.head(gelu(self.fc2(gelu(self.fc1(x))))).float().pow(2).mean()


def train(persist: bool) -> dict:
    from peft import LoraConfig, get_peft_model

    config = ds_config(3, micro_batch=2)
    if persist:  # DeepSpeed's default threshold (1e5 elements): every parameter here persists
        del config["zero_optimization"]["stage3_param_persistence_threshold"]
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        net = Net()
    model = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"], init_lora_weights=False))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2), config=config)
    dtypes = sorted({str(getattr(p, "ds_tensor", p).dtype) for p in engine.module.parameters() if p.requires_grad})
    losses = train_small(engine, STEPS)
    return {"losses": losses, "trainable_dtypes": dtypes, **param_digest(engine)}


def main():
    out, results = begin()
    results["reference"] = attempt(train, False)
    results["without"] = attempt(train, True)
    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()[NAME].as_dict()
    results["with"] = attempt(train, True)
    results["regrouped"] = zeroshim.stats(NAME)["regrouped"]
    zeroshim.configure(only=[NAME])
    results["alone"] = attempt(train, True)
    results["regrouped_alone"] = zeroshim.stats(NAME)["regrouped"] - results["regrouped"]
    end(out, results)


if __name__ == "__main__":
    main()
