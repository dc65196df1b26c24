"""Scenario for patch ``warmup_lr_groups``: DeepSpeed's ``WarmupLR`` from the config, without
``warmup_max_lr``, over a client AdamW with two param groups (the first layer at 1e-3, the second at
1e-5).  A 16 -> 32 -> 4 MLP, fp32, ZeRO-2, 2 ranks, 4 steps (warmup over 2).

Runs, in one process per rank:

* ``reference``: the config with ``warmup_max_lr: [1e-3, 1e-5]`` written out (each group's own rate);
* ``without``: no ``warmup_max_lr``, no zeroshim (DeepSpeed 0.17.2 - 0.19.3: both groups end at 1e-3);
* ``with``: the same with zeroshim (each group at its own rate, as the reference);
* ``same/without``, ``same/with``: both groups at 1e-3 and no ``warmup_max_lr``: nothing to change, the two
  runs must be equal bit for bit (the patch does not act).

Each run records the learning rate of every group after every step, the losses and a digest of the
parameters.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
H, STEPS, MICRO = 16, 4, 2
RATES = (1e-3, 1e-5)


def train(rates, max_lr=None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, 4))
    groups = [{"params": model[0].parameters(), "lr": rates[0]}, {"params": model[2].parameters(), "lr": rates[1]}]
    cfg = ds_config(2, micro_batch=MICRO, bf16=False)
    params = {"warmup_min_lr": 0.0, "warmup_num_steps": 2, "warmup_type": "linear"}
    if max_lr is not None:
        params["warmup_max_lr"] = list(max_lr)
    cfg["scheduler"] = {"type": "WarmupLR", "params": params}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups), config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses, lrs = [], []
    for _ in range(STEPS):
        loss = engine(torch.randn(MICRO, H, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append([group["lr"] for group in engine.optimizer.param_groups])
    return {"losses": losses, "lrs": lrs, "scheduler": type(engine.lr_scheduler).__name__, **param_digest(engine)}


def main():
    out, results = begin()
    results["reference"] = attempt(train, RATES, max_lr=RATES)
    results["without"] = attempt(train, RATES)
    results["same/without"] = attempt(train, (RATES[0], RATES[0]))

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["warmup_lr_groups"].as_dict()
    results["with"] = attempt(train, RATES)
    results["same/with"] = attempt(train, (RATES[0], RATES[0]))
    results["stats"] = dict(zeroshim.stats("warmup_lr_groups"))
    end(out, results)


if __name__ == "__main__":
    main()
