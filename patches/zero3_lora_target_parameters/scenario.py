"""Scenario for patch ``zero3_lora_target_parameters``: a model built under
``deepspeed.zero.Init`` (ZeRO-3, so its parameters are partition placeholders
from the start), peft LoRA with ``target_parameters`` on a 2-D weight
(``fc1.weight``) and on a 3-D fused-experts parameter (``experts.w``), 3 steps.

* ``reference``: the workaround peft's maintainers gave (peft #2916): build
  the peft model inside ``deepspeed.zero.GatheredParameters`` of the targeted
  parameters;
* ``without``: no zeroshim (peft 0.17.0 - 0.20.0: ``IndexError: tuple index
  out of range`` in ``ParamWrapper``);
* ``with``: zeroshim, the plain ``get_peft_model`` call.

Each records the losses and a digest of the parameter shards (``param_digest``).
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest, train_small

# runs compared here read parameters through DeepSpeed's blocking ZeRO-3 gathers, which race on gloo before
# 0.19.8: patch zero3_gloo_gather stays on in the runs without zeroshim too (not the subject here)
deepspeed = import_deepspeed(fix_gloo_gathers=True)
STEPS = 3
TARGETS = ["fc1.weight", "experts.w"]


class Experts(nn.Module):
    """Fused experts, one (experts, in, out) parameter, as transformers 5 builds MoE blocks."""

    def __init__(self, n=3, d_in=16, d_out=8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, d_in, d_out) * 0.1)

    def forward(self, x):
        return torch.einsum("bi,eio->beo", x, self.w).mean(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.experts = Experts()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.experts(self.act(self.fc1(x)))).float().pow(2).mean()


def train(gather_first: bool) -> dict:
    from peft import LoraConfig, get_peft_model

    config = ds_config(3, micro_batch=2)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        net = Net()
    lora = LoraConfig(r=4, lora_alpha=8, target_parameters=TARGETS)
    if gather_first:
        with deepspeed.zero.GatheredParameters([net.fc1.weight, net.experts.w], modifier_rank=None):
            model = get_peft_model(net, lora)
    else:
        model = get_peft_model(net, lora)
    wrappers = sorted(type(m).__name__ for m in model.modules() if type(m).__name__ == "ParamWrapper")
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2), config=config)
    losses = train_small(engine, STEPS)
    return {"losses": losses, "wrappers": wrappers, **param_digest(engine)}


def main():
    out, results = begin()
    results["reference"] = attempt(train, True)
    results["without"] = attempt(train, False)
    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero3_lora_target_parameters"].as_dict()
    results["with"] = attempt(train, False)
    results["gathered"] = zeroshim.stats("zero3_lora_target_parameters")["gathered"]
    end(out, results)


if __name__ == "__main__":
    main()
