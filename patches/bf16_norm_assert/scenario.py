"""Scenario for patch ``bf16_norm_assert``: bf16, ZeRO stage 1 with ``data_types.grad_accum_dtype`` fp32 (DeepSpeed's
``BF16_Optimizer`` on the releases that build it for that config), a 4 -> 2 linear layer, 2 ranks, 3 steps, SGD
without momentum or weight decay (so a step with zero gradients leaves the weights as they are), clipping at 1.0.

Runs, in one process per rank:

* ``zero/without``, ``zero/with``: the second step's loss multiplied by 0 (every gradient exactly 0);
* ``inf/without``, ``inf/with``: the second step's input inf on every rank (the norm is not finite);
* ``reference``: the first and third steps only (what taking a zero step and skipping a non-finite one leave);
* ``clean/without``, ``clean/with``: three finite steps;
* ``adamw/zero/with``, ``adamw/reference``: the zero case with AdamW and weight decay, and AdamW's first and third
  steps only (0.19.8 takes the zero step, so the weights move by the decay and the momentum: the two differ).

Each run records the optimizer's class, the losses of the first and last step, the gradient norm reported after
each step, the engine's ``skipped_steps`` and a digest of the parameters.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()


def train(mode, steps=(0, 1, 2), adamw=False) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    cfg = ds_config(1, micro_batch=1, bf16=True, clip=1.0)
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    optimizer = torch.optim.AdamW(model.parameters(), lr=2**-4, weight_decay=0.1) if adamw else \
        torch.optim.SGD(model.parameters(), lr=2**-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    losses, norms, skipped = {}, [], []
    for step in steps:
        scale = float("inf") if mode == "inf" and step == 1 else 1.0 + step
        out = engine(torch.full((1, 4), scale, dtype=torch.bfloat16)).float().sum()
        loss = out * 0 if mode == "zero" and step == 1 else out
        engine.backward(loss)
        engine.step()
        losses[step] = repr(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        skipped.append(engine.skipped_steps)
    return {"optimizer": type(engine.optimizer).__name__, "ends": [losses[0], losses[2]], "grad_norms": norms,
            "skipped_steps": skipped, **param_digest(engine)}


def main():
    out, results = begin()
    results["zero/without"] = attempt(train, "zero")
    results["inf/without"] = attempt(train, "inf")
    results["reference"] = attempt(train, "clean", steps=(0, 2))
    results["clean/without"] = attempt(train, "clean")

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["bf16_norm_assert"].as_dict()
    results["zero/with"] = attempt(train, "zero")
    results["inf/with"] = attempt(train, "inf")
    results["clean/with"] = attempt(train, "clean")
    results["adamw/zero/with"] = attempt(train, "zero", adamw=True)
    results["adamw/reference"] = attempt(train, "clean", steps=(0, 2), adamw=True)
    results["stats"] = dict(zeroshim.stats("bf16_norm_assert"))
    end(out, results)


if __name__ == "__main__":
    main()
