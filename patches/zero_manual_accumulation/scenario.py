"""Scenario for patch ``zero_manual_accumulation``: accumulation by hand, ``gradient_accumulation_steps`` 1
and K = 3 ``engine.backward()`` calls before each ``engine.step()`` (what RL trainers and custom loops do).
A 16 -> 32 -> 4 MLP, AdamW, fp32, 3 optimizer steps, inputs drawn per rank.

Loops (``train``'s ``loop``):

* ``manual``: K backward calls, then one step;
* ``boundary``: the same with DeepSpeed's own marking, ``engine.set_gradient_accumulation_boundary(False)``
  before every backward but the last (``True`` before it): the sum of the K micro-batches, the reference;
* ``each``: the ordinary loop, a step after every backward (must stay as it is);
* ``unmanaged``: ``"managed_gradient_accumulation": false`` (DeepSpeed >= 0.19.4; elsewhere recorded as skipped).

Runs (``without`` and ``with`` are ZeRO-2):

* ``reference``: stage 0, ``manual``, no zeroshim: stage 0 sums the backward calls on every release (and
  ``z0/with``: the same with zeroshim, left alone);
* ``without``: ``manual``, no zeroshim (DeepSpeed >= 0.18.3 keeps the last micro-batch only, 0.17.6 - 0.18.2
  fail); ``with``: ``manual`` with zeroshim;  ``z1/{without,with}``: the same at ZeRO-1;
* ``z2/boundary/without``, ``z1/boundary/without``: the ``boundary`` loop (DeepSpeed's own marking; the
  bit-for-bit comparison where it is right, which it is not at ZeRO-2 on 0.17.6 - 0.18.2);
* ``z3/...``: ZeRO-3 ``manual``, which sums by itself (left alone);
* ``z2/each/...``: the ordinary loop; ``z2/unmanaged/...``: the unmanaged mode;
* ``z2off/...``, ``z1off/...``: ``manual`` with ``offload_optimizer`` (wrong on every release; with
  zeroshim: the error); ``z2off/boundary/...``: the ``boundary`` loop with offload (wrong before 0.19.0: with
  zeroshim, the error; from 0.19.0 right, and no error).

Each attempt records the losses and every parameter value this rank holds.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
STEPS, K, MICRO = 3, 3, 2


def train(stage: int, loop: str, offload: bool = False) -> dict:
    from deepspeed.runtime.engine import DeepSpeedEngine

    if loop == "unmanaged" and not hasattr(DeepSpeedEngine, "managed_gradient_accumulation"):
        return {"skipped": "no managed_gradient_accumulation before DeepSpeed 0.19.4"}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    cfg = ds_config(stage, micro_batch=MICRO, bf16=False, **zero)
    cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW on the offloaded partition (no CPU Adam JIT build)
    if loop == "unmanaged":
        cfg["managed_gradient_accumulation"] = False
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        for i in range(K):
            loss = engine(torch.randn(MICRO, 16, generator=gen)).pow(2).mean()
            if loop == "boundary":
                engine.set_gradient_accumulation_boundary(i == K - 1)
            engine.backward(loss)
            if loop == "each":
                engine.step()
            losses.append(loss.item())
        if loop != "each":
            engine.step()
    return {"losses": losses, **param_digest(engine, values=True)}


def runs(tag: str) -> dict:
    out = {}
    if tag == "without":  # stage 0 sums the backward calls on every release: the reference
        out["reference"] = attempt(train, 0, "manual")
        out["z2/boundary/without"] = attempt(train, 2, "boundary")
        out["z1/boundary/without"] = attempt(train, 1, "boundary")
    else:
        out["z0/with"] = attempt(train, 0, "manual")
    out[tag] = attempt(train, 2, "manual")
    out[f"z1/{tag}"] = attempt(train, 1, "manual")
    out[f"z3/{tag}"] = attempt(train, 3, "manual")
    out[f"z2/each/{tag}"] = attempt(train, 2, "each")
    out[f"z2/unmanaged/{tag}"] = attempt(train, 2, "unmanaged")
    out[f"z2off/{tag}"] = attempt(train, 2, "manual", True)
    out[f"z1off/{tag}"] = attempt(train, 1, "manual", True)
    out[f"z2off/boundary/{tag}"] = attempt(train, 2, "boundary", True)
    return out


def main():
    out, results = begin()
    results.update(runs("without"))

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero_manual_accumulation"].as_dict()
    results.update(runs("with"))
    results["stats"] = zeroshim.stats("zero_manual_accumulation")
    end(out, results)


if __name__ == "__main__":
    main()
