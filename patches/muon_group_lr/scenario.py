"""Scenario for patch ``muon_group_lr``: DeepSpeed's Muon optimizer from the config with ``lr`` and ``muon_lr``
0.02 and ``adam_lr`` 3e-4 (OpenRLHF's form).  A small language model (embedding 32 x 16, two 16 x 16 linear
layers, a norm, a 16 -> 32 head: the linear weights in the Muon group, the rest in the Adam group), fp32, ZeRO-2,
2 ranks, 3 steps.

Runs, in one process per rank:

* ``reference``: the optimizer DeepSpeed 0.18.3 builds from that config, passed as a client optimizer:
  ``MuonWithAuxAdam`` with the Muon group at 0.02 and the Adam group at 3e-4;
* ``without``: the config, no zeroshim (DeepSpeed 0.17.6 - 0.18.2: both groups at 0.02);
* ``with``: the same with zeroshim (each group at its own rate, as the reference);
* ``same/without``, ``same/with``: ``muon_lr`` and ``adam_lr`` both 0.02, the value of ``lr``: nothing to
  change, the two runs must be equal bit for bit (the patch does not act).

Each run records the learning rate of each group after every step, the losses and a digest of the parameters.
"""

import torch
import torch._dynamo

from common import TinyLM as Tiny, attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
# DeepSpeed >= 0.18.3 compiles Muon's kernels with torch.compile on their first call (13 s a process here), which
# nothing the rates depend on needs; every run here runs them eagerly alike
torch._dynamo.config.disable = True
VOCAB, STEPS, MICRO = Tiny.VOCAB, 3, 2
MUON_LR, ADAM_LR = 0.02, 3e-4


def _client_muon(model):
    """The optimizer DeepSpeed >= 0.18.3 builds for this config: its own ``use_muon`` rule
    (``deepspeed.set_optimizer_flags``) and each group at its own rate."""
    from types import SimpleNamespace

    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    deepspeed.set_optimizer_flags(SimpleNamespace(optimizer_name="muon"), model)
    params = list(model.parameters())
    return MuonWithAuxAdam([dict(params=[p for p in params if p.use_muon], use_muon=True, lr=MUON_LR),
                            dict(params=[p for p in params if not p.use_muon], use_muon=False, lr=ADAM_LR)])


def train(adam_lr=ADAM_LR, client=False) -> dict:
    torch.manual_seed(0)
    model = Tiny()
    cfg = ds_config(2, micro_batch=MICRO, bf16=False)
    if client:
        engine, *_ = deepspeed.initialize(model=model, optimizer=_client_muon(model), config=cfg)
    else:
        # torch_adam: DeepSpeed >= 0.19 runs Muon's Adam group with FusedAdam, a C++ op built on first use (minutes
        # on a small CPU) unless torch's AdamW is asked for; 0.17.6 - 0.18.x drop the key with the others
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": MUON_LR, "muon_lr": MUON_LR, "adam_lr": adam_lr,
                                                       "torch_adam": True}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses, lrs = [], []
    for _ in range(STEPS):
        loss = engine(torch.randint(0, VOCAB, (MICRO, 8), generator=gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append({("muon" if g["use_muon"] else "adam"): g["lr"] for g in engine.optimizer.param_groups})
    return {"losses": losses, "lrs": lrs, "optimizer": type(engine.basic_optimizer).__name__,
            **param_digest(engine)}


def main():
    out, results = begin()
    results["reference"] = attempt(train, client=True)
    results["without"] = attempt(train)
    results["same/without"] = attempt(train, adam_lr=MUON_LR)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["muon_group_lr"].as_dict()
    results["with"] = attempt(train)
    results["same/with"] = attempt(train, adam_lr=MUON_LR)
    results["stats"] = dict(zeroshim.stats("muon_group_lr"))
    end(out, results)


if __name__ == "__main__":
    main()
