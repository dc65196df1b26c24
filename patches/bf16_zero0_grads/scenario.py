"""Scenario for patch ``bf16_zero0_grads``: bf16 without ZeRO and without fp32 gradient accumulation (DeepSpeed's
fp16 wrapper, ``FP16_UnfusedOptimizer``, around a client AdamW), a 16 -> 32 -> 4 MLP, 2 ranks, each its own data,
4 steps of ``engine.backward()`` and ``engine.step()``.

Runs, in one process per rank:

* ``reference``: the remedy a user can write without zeroshim: the ``fp16`` section's ``loss_scale`` set to 1 (a
  static scale of 1; ``fp16`` itself stays off) and ``engine.zero_grad()`` after each step (what DeepSpeed 0.18.6
  does itself);
* ``without``: the plain loop, no zeroshim (0.17.6-0.18.5: the gradients are summed over the steps; 0.18.3-0.18.5
  also divide them by 65536);
* ``cleared/without``: the loop clears the gradients itself, as the HF Trainer does (0.17.6-0.18.2: the same steps
  as the reference, bit for bit, and a reported gradient norm 65536 times larger; 0.18.3-0.18.5: divided by 65536);
* ``with``, ``cleared/with``: the plain and the clearing loop with zeroshim (as the reference);
* ``other/without``, ``other/with``: bf16 under ZeRO-2 (DeepSpeed's ZeRO optimizer, not the fp16 wrapper): nothing to
  change, the two runs must be equal bit for bit;
* ``zero1fp32/without``, ``zero1fp32/with``: bf16 ZeRO-1 with ``grad_accum_dtype`` fp32, where ``BF16_Optimizer`` was
  asked for: DeepSpeed 0.17.6-0.18.4 build the fp16 wrapper instead (on 0.18.2 its loss is multiplied by the scale:
  the same parameters with and without zeroshim; 0.18.5 builds ``BF16_Optimizer``: nothing to change);
* ``loaded``: a wrapper built with zeroshim loads the state dict of one built without it (dynamic scale 65536): its
  scale after the load.

Each run records the losses, the gradient norm DeepSpeed reports at each step, the optimizer DeepSpeed chose, its
loss scale, whether gradients are left on the parameters after the last step, and a digest of the parameters.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
H, STEPS, MICRO = 16, 4, 4


def build(scale_one=False, stage=0, fp32_accum=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, 4))
    cfg = ds_config(stage, micro_batch=MICRO)
    if scale_one:
        cfg["fp16"] = {"enabled": False, "loss_scale": 1.0}
    if fp32_accum:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=cfg)
    return engine


def train(scale_one=False, clear=False, stage=0, fp32_accum=False) -> dict:
    engine = build(scale_one, stage, fp32_accum)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses, norms = [], []
    for _ in range(STEPS):
        x = torch.randn(MICRO, H, generator=gen).to(torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if clear:
            engine.zero_grad()
        losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    left = any(p.grad is not None for p in engine.module.parameters())
    return {"losses": losses, "grad_norms": norms, "optimizer": type(engine.optimizer).__name__,
            "cur_scale": getattr(engine.optimizer, "cur_scale", None), "grads_left": left, **param_digest(engine)}


def loaded(state) -> dict:
    optimizer = build().optimizer
    before = (optimizer.cur_scale, optimizer.dynamic_loss_scale)
    optimizer.load_state_dict(state)
    return {"before": list(before), "after": [optimizer.cur_scale, optimizer.dynamic_loss_scale],
            "loaded": [state["cur_scale"], state["dynamic_loss_scale"]]}


def main():
    out, results = begin()
    results["reference"] = attempt(train, scale_one=True, clear=True)
    results["without"] = attempt(train)
    results["cleared/without"] = attempt(train, clear=True)
    results["other/without"] = attempt(train, stage=2)
    results["zero1fp32/without"] = attempt(train, stage=1, fp32_accum=True)
    state = build().optimizer.state_dict()

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["bf16_zero0_grads"].as_dict()
    results["with"] = attempt(train)
    results["cleared/with"] = attempt(train, clear=True)
    results["other/with"] = attempt(train, stage=2)
    results["zero1fp32/with"] = attempt(train, stage=1, fp32_accum=True)
    results["loaded"] = attempt(loaded, state)
    results["stats"] = dict(zeroshim.stats("bf16_zero0_grads"))
    end(out, results)


if __name__ == "__main__":
    main()
