"""Scenario for patch ``zero2_accumulation_overwrite``: fp32, a bias-free 8 -> 4 linear layer with small-integer
weights, SGD at a learning rate of 2**-6, 2 ranks, each its own small-integer data, 2 steps.  Every gradient, average
and sum is then exact in fp32 whatever its order, so stages that reduce in a different order train to the same bits.

Runs, in one process per rank:

* ``reference``: ZeRO-1 with ``gradient_accumulation_steps`` 4 (it reduces once, at the boundary: right on every
  release);
* ``without``: ZeRO-2 with ``gradient_accumulation_steps`` 4, no zeroshim (DeepSpeed 0.17.6-0.18.2: only the
  last micro-batch of each step counts);
* ``with``: the same with zeroshim (as the reference);
* ``last_only``: ZeRO-1 where the first three micro-batches of each step have a loss of zero: what the bug keeps;
* ``ga1/without``, ``ga1/with``: ZeRO-2 with ``gradient_accumulation_steps`` 1 (nothing to accumulate, nothing to
  change: equal bit for bit);
* ``marked/reference``, ``marked/without``, ``marked/with``: ``gradient_accumulation_steps`` 1 and
  ``engine.set_gradient_accumulation_boundary(False)`` before the first three backward calls of each step, ZeRO-1
  (the reference) and ZeRO-2 without and with zeroshim;
* ``mlp/...``: a 16 -> 32 -> 4 MLP with GELU and AdamW, ZeRO-1 (``mlp/reference``) and ZeRO-2 without and with
  zeroshim, 4 micro-batches a step: not exact, for the gradient norms DeepSpeed reports (recorded, not judged).

Each run records the losses, the gradient norm DeepSpeed reports at each step and a digest of the parameters.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
MICRO, STEPS = 4, 2


def train(stage, ga=4, mlp=False, last_only=False, marked=False) -> dict:
    torch.manual_seed(0)
    if mlp:
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        model = nn.Linear(8, 4, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.randint(-2, 3, (4, 8)).float())
        optimizer = torch.optim.SGD(model.parameters(), lr=2**-6)
    cfg = ds_config(stage, micro_batch=MICRO, bf16=False)
    cfg["gradient_accumulation_steps"] = 1 if marked else ga
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses, norms = [], []
    for micro in range(STEPS * ga):
        last = micro % ga == ga - 1
        if mlp:
            x, y = torch.randn(MICRO, 16, generator=gen), torch.randn(MICRO, 4, generator=gen)
        else:
            x = torch.randint(-2, 3, (MICRO, 8), generator=gen).float()
            y = torch.randint(-2, 3, (MICRO, 4), generator=gen).float()
        loss = (engine(x) - y).pow(2).mean()
        if last_only and not last:
            loss = loss * 0
        if marked:
            engine.set_gradient_accumulation_boundary(last)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        if not marked or last:
            engine.step()
        losses.append(loss.item())
        if boundary:
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
    return {"losses": losses, "grad_norms": norms, "optimizer": type(engine.optimizer).__name__,
            **param_digest(engine)}


def main():
    out, results = begin()
    results["reference"] = attempt(train, 1)
    results["without"] = attempt(train, 2)
    results["last_only"] = attempt(train, 1, last_only=True)
    results["ga1/without"] = attempt(train, 2, ga=1)
    results["marked/reference"] = attempt(train, 1, marked=True)
    results["marked/without"] = attempt(train, 2, marked=True)
    results["mlp/reference"] = attempt(train, 1, mlp=True)
    results["mlp/without"] = attempt(train, 2, mlp=True)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero2_accumulation_overwrite"].as_dict()
    results["with"] = attempt(train, 2)
    results["ga1/with"] = attempt(train, 2, ga=1)
    results["marked/with"] = attempt(train, 2, marked=True)
    results["mlp/with"] = attempt(train, 2, mlp=True)
    results["stats"] = dict(zeroshim.stats("zero2_accumulation_overwrite"))
    end(out, results)


if __name__ == "__main__":
    main()
