"""Scenario for patch ``silent_overflow_skip``: ZeRO-1 and ZeRO-2 in bf16 with ``"check_grad_overflow": true``
(DeepSpeed's default from 0.19.3; written out so that 0.17.1-0.19.2 check too), a 4 -> 1 linear layer, SGD, 2 ranks,
3 steps; the second step's input is inf on every rank, so its gradients are inf and DeepSpeed skips it.

Runs, in one process per rank, for ZeRO stage ``s`` in 1 and 2:

* ``s/without``, ``s/with``: the three steps without and with zeroshim;
* ``s/clean/without``, ``s/clean/with``: three finite steps without and with zeroshim.

Each run records the losses (as ``repr``: a skipped step's loss is nan), the gradient norm the engine reports after
each step, the engine's ``skipped_steps`` and a digest of the parameters.  The launch log holds what was said.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
STEPS = 3


def train(stage, overflow=True) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    cfg = ds_config(stage, micro_batch=1, bf16=True)
    cfg["bf16"]["check_grad_overflow"] = True
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=2**-4),
                                      config=cfg)
    losses, norms, skipped = [], [], []
    for step in range(STEPS):
        scale = float("inf") if overflow and step == 1 else 1.0 + step
        loss = engine(torch.full((1, 4), scale, dtype=torch.bfloat16)).float().sum()
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm()
        losses.append(repr(loss.item()))
        norms.append(None if norm is None else float(norm))
        skipped.append(engine.skipped_steps)
    return {"losses": losses, "grad_norms": norms, "skipped_steps": skipped, **param_digest(engine)}


def main():
    out, results = begin()
    for stage in (1, 2):
        results[f"{stage}/without"] = attempt(train, stage)
        results[f"{stage}/clean/without"] = attempt(train, stage, overflow=False)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["silent_overflow_skip"].as_dict()
    for stage in (1, 2):
        results[f"{stage}/with"] = attempt(train, stage)
        results[f"{stage}/clean/with"] = attempt(train, stage, overflow=False)
    results["stats"] = dict(zeroshim.stats("silent_overflow_skip"))
    end(out, results)


if __name__ == "__main__":
    main()
