"""Scenario for patch ``muon_zero_supported``: DeepSpeed's Muon optimizer from the config (``lr`` 0.02) under ZeRO-1
and ZeRO-2 on a small language model (embedding 32 x 16, two 16 x 16 linear layers, a norm, a 16 -> 32 head), fp32,
2 ranks, 3 steps.

Runs, for each stage, in one process per rank:

* ``reference``: the config with ``"zero_allow_untested_optimizer": true`` (what DeepSpeed's message asks for);
* ``without``: the config without the key, no zeroshim (DeepSpeed 0.17.6 - 0.18.4: refused, "You are using an
  untested ZeRO Optimizer");
* ``with``: the same with zeroshim (as the reference);
* ``allowed/with``: the reference's config with zeroshim: nothing to change.

Each run records the losses and a digest of the parameters.
"""

import torch
import torch._dynamo

from common import TinyLM as Tiny, attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
# DeepSpeed >= 0.18.3 compiles Muon's kernels with torch.compile on their first call; every run here runs them
# eagerly alike
torch._dynamo.config.disable = True
VOCAB, STEPS, MICRO = Tiny.VOCAB, 3, 2
STAGES = (1, 2)


def train(stage: int, allow: bool) -> dict:
    torch.manual_seed(0)
    model = Tiny()
    cfg = ds_config(stage, micro_batch=MICRO, bf16=False)
    del cfg["zero_allow_untested_optimizer"]
    if allow:
        cfg["zero_allow_untested_optimizer"] = True
    # torch_adam: DeepSpeed >= 0.19 runs Muon's Adam group with FusedAdam, a C++ op built on first use, unless
    # torch's AdamW is asked for; 0.17.6 - 0.18.x drop the key
    cfg["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "torch_adam": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = engine(torch.randint(0, VOCAB, (MICRO, 8), generator=gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "optimizer": type(engine.basic_optimizer).__name__, **param_digest(engine)}


def main():
    out, results = begin()
    for stage in STAGES:
        results[f"zero{stage}/reference"] = attempt(train, stage, allow=True)
        results[f"zero{stage}/without"] = attempt(train, stage, allow=False)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["muon_zero_supported"].as_dict()
    for stage in STAGES:
        results[f"zero{stage}/with"] = attempt(train, stage, allow=False)
        results[f"zero{stage}/allowed/with"] = attempt(train, stage, allow=True)
    results["stats"] = dict(zeroshim.stats("muon_zero_supported"))
    end(out, results)


if __name__ == "__main__":
    main()
