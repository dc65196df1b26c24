"""Scenario for patch ``zero_no_sync``: a training loop that wraps the backward of
every non-boundary micro-step in ``engine.no_sync()`` (what transformers' Trainer
4.46.2 – 4.47.0 and accelerate < 1.9.0's ``accumulate``/``no_sync`` end up
doing, and what RL loops do by hand).  A 16 -> 32 -> 4 MLP, AdamW, fp32,
3 optimizer steps, inputs drawn per rank.

Runs, in one process per rank (``z{stage}/ga{N}/{tag}``; ``reference``,
``without`` and ``with`` are ZeRO-3 with gradient accumulation 4):

* ``reference``: the same loop without ``no_sync``;
* ``without``: with ``no_sync``, no zeroshim (DeepSpeed >= 0.16.0 asserts);
* ``with``: with ``no_sync`` and zeroshim;
* ZeRO-2 and ZeRO-3 at gradient accumulation 2 and 4;
* ``z1/ga2/{without,with}``: ZeRO-1, where DeepSpeed's own ``no_sync`` works
  and must stay untouched (``z1_nulled`` counts what the patch did there: 0).
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
STEPS, MICRO = 3, 2


def train(stage: int, ga: int, use_no_sync: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    cfg = ds_config(stage, micro_batch=MICRO, bf16=False, clip=1.0)
    cfg["gradient_accumulation_steps"] = ga
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS * ga):
        loss = engine(torch.randn(MICRO, 16, generator=gen)).pow(2).mean()
        if use_no_sync and not engine.is_gradient_accumulation_boundary():
            with engine.no_sync():
                engine.backward(loss)
        else:
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, **param_digest(engine)}


def runs(tag: str, use_no_sync: bool) -> dict:
    out = {tag: attempt(train, 3, 4, use_no_sync)}
    for stage in (2, 3):
        for ga in (2, 4):
            if (stage, ga) != (3, 4):
                out[f"z{stage}/ga{ga}/{tag}"] = attempt(train, stage, ga, use_no_sync)
    return out


def main():
    out, results = begin()
    results.update(runs("reference", use_no_sync=False))
    results.update(runs("without", use_no_sync=True))
    results["z1/ga2/without"] = attempt(train, 1, 2, True)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero_no_sync"].as_dict()
    results.update(runs("with", use_no_sync=True))
    before = zeroshim.stats("zero_no_sync")["nulled"]
    results["z1/ga2/with"] = attempt(train, 1, 2, True)
    results["z1_nulled"] = zeroshim.stats("zero_no_sync")["nulled"] - before
    results["nulled"] = before
    end(out, results)


if __name__ == "__main__":
    main()
