"""Scenario for patch ``zero3_gloo_gather``: a 4-layer MLP (8 parameters) under a
ZeRO-3 engine on gloo (2 ranks, ``stage3_param_persistence_threshold: 0``),
its parameters read back over and over through DeepSpeed's blocking gathers,
then trained.

* ``reference``: the engine trained for ``STEPS`` steps, nothing gathered
  (losses and each rank's own shards, :func:`common.param_digest`);
* ``without`` / ``with`` (no zeroshim / zeroshim): ``GATHERS`` gathers of all
  parameters (``GatheredParameters(params, modifier_rank=None)``), each
  compared with the parameters as built, bit for bit; ``SAVES`` consolidated
  state dicts (``engine._zero3_consolidated_16bit_state_dict()``, what
  ``save_16bit_model`` and Trainer's ZeRO-3 save call: one gather per module,
  ``modifier_rank=0``), each compared on rank 0; then the same ``STEPS``
  training steps as the reference.

Each run records how many gathers/state dicts read anything but the
parameters, and the first wrong value.  The race is timing-dependent: on this
2-core machine without zeroshim (DeepSpeed 0.16.9) about 7 of 100 gathers of 8
parameters read a wrong one, and after 100 consolidations the model being
trained had itself changed (the exit of ``modifier_rank=0`` broadcasts rank
0's half-written copy into every rank's shard).

``persistent/*``: ordinary training, 30 steps, of 24 Linear + LayerNorm
pairs with DeepSpeed's default persistence threshold (every parameter
persistent: ``_post_step`` gathers them all after each step through the same
gather) without and with zeroshim, against ``persistent/reference``, the same
training with threshold 0 (nothing persistent).  Without zeroshim the last
loss differed from the reference in 1 of 3 runs on 0.16.9 (recorded, not
required: timing-dependent).
"""


import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
NAME = "zero3_gloo_gather"
GATHERS, SAVES, STEPS = 600, 100, 3
PERSISTENT_STEPS = 30


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 4))


def reference() -> dict:
    return {k: v.detach().clone() for k, v in build().state_dict().items()}


def first_wrong(values: dict, expected: dict) -> "str | None":
    for key, want in expected.items():
        got = values[key].float()
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[0].tolist()
            return f"{key}{bad}: {got[tuple(bad)].item()!r} instead of {want[tuple(bad)].item()!r}"
    return None


def engine_of() -> "deepspeed.DeepSpeedEngine":
    model = build()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=ds_config(3, micro_batch=2, bf16=False))
    return engine


def steps(engine, count: int, width: int) -> list:
    """``count`` optimizer steps on fp32 inputs drawn per rank (the same in every run); the losses."""
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses = []
    for _ in range(count):
        loss = engine(torch.randn(2, width, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train(engine) -> dict:
    return {"losses": steps(engine, STEPS, 32), **param_digest(engine)}


def reference_run() -> dict:
    return train(engine_of())


def run(expected: dict) -> dict:
    engine = engine_of()
    names = [n for n, _ in engine.module.named_parameters()]
    params = [p for _, p in engine.module.named_parameters()]
    wrong_gathers, first = 0, None
    for _ in range(GATHERS):
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            wrong = first_wrong({n: p.data.detach().clone() for n, p in zip(names, params)}, expected)
        wrong_gathers += wrong is not None
        first = first or wrong
    # what Trainer's ZeRO-3 save (accelerate's get_state_dict) and save_16bit_model call: one gather per module
    # with modifier_rank=0, whose exit broadcasts rank 0's copy back into every rank's shard
    rank = torch.distributed.get_rank()
    wrong_saves, first_save = 0, None
    for _ in range(SAVES):
        state = engine._zero3_consolidated_16bit_state_dict()
        if rank == 0:
            wrong = first_wrong(state, expected)
            wrong_saves += wrong is not None
            first_save = first_save or wrong
    return {"gathers": GATHERS, "wrong_gathers": wrong_gathers, "first_wrong": first,
            "saves": SAVES if rank == 0 else 0, "wrong_saves": wrong_saves, "first_wrong_save": first_save,
            **train(engine)}


def persistent_run(threshold_zero: bool) -> dict:
    """ZeRO-3 training of 24 Linear + LayerNorm pairs (width 64): with DeepSpeed's default persistence
    threshold every parameter is persistent, and after every optimizer step ``_post_step`` gathers them all
    through the blocking gather; with threshold 0 none is persistent (the reference)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(24) for m in (nn.Linear(64, 64), nn.LayerNorm(64))])
    config = ds_config(3, micro_batch=2, bf16=False)
    if not threshold_zero:
        del config["zero_optimization"]["stage3_param_persistence_threshold"]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                      config=config)
    return {"losses": steps(engine, PERSISTENT_STEPS, 64),
            "persistent": len(getattr(engine.optimizer, "persistent_parameters", []))}


def main():
    out, results = begin()
    expected = reference()
    results["reference"] = attempt(reference_run)
    results["persistent/reference"] = attempt(persistent_run, True)
    results["without"] = attempt(run, expected)
    results["persistent/without"] = attempt(persistent_run, False)
    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()[NAME].as_dict()
    results["with"] = attempt(run, expected)
    results["persistent/with"] = attempt(persistent_run, False)
    results["stats"] = zeroshim.stats(NAME)
    end(out, results)


if __name__ == "__main__":
    main()
