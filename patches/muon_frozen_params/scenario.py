"""Scenario for patch ``muon_frozen_params``: DeepSpeed's Muon optimizer from the config (``lr`` 0.02,
``weight_decay`` 0.1) on a partly frozen small language model (embedding 32 x 16, two 16 x 16 linear layers, a
norm, a 16 -> 32 head: the linear weights in the Muon group, the rest in the Adam group), fp32, 2 ranks, 3 steps,
``deepspeed.initialize(model_parameters=model.parameters())``.

Cases, each run ``reference`` (only the trainable parameters passed: the groups DeepSpeed 0.18.7 builds),
``without`` (no zeroshim) and ``with`` (zeroshim), in one process per rank:

* ``zero2/adapters``: ZeRO-2, only the two linear weights train (all Muon matrices, as LoRA adapters are):
  without zeroshim on DeepSpeed 0.17.6 - 0.18.6 ``deepspeed.initialize`` fails (``torch.cat``);
* ``zero0/frozen_embed``: no ZeRO, the embedding and the norm frozen: without zeroshim they decay;
* ``zero2/mixed``: ZeRO-2, the embedding and one linear layer frozen (both groups keep trainable members): ZeRO
  leaves the frozen ones out itself, so the runs must be equal bit for bit and the patch must not act.

Each run records the losses, a digest of the parameters and the names of the frozen parameters that moved.
"""

import torch
import torch._dynamo

from common import TinyLM as Tiny, attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
# DeepSpeed >= 0.18.3 compiles Muon's kernels with torch.compile on their first call; every run here runs them
# eagerly alike
torch._dynamo.config.disable = True
VOCAB, STEPS, MICRO = Tiny.VOCAB, 3, 2
CASES = {
    "zero2/adapters": (2, lambda name: name in ("fc1.weight", "fc2.weight")),
    "zero0/frozen_embed": (0, lambda name: not name.startswith(("embed", "norm"))),
    "zero2/mixed": (2, lambda name: not name.startswith(("embed", "fc1"))),
}


def train(case: str, reference: bool = False) -> dict:
    stage, trains = CASES[case]
    torch.manual_seed(0)
    model = Tiny()
    for name, p in model.named_parameters():
        p.requires_grad_(trains(name))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    cfg = ds_config(stage, micro_batch=MICRO, bf16=False)
    # torch_adam: DeepSpeed >= 0.19 runs Muon's Adam group with FusedAdam, a C++ op built on first use, unless
    # torch's AdamW is asked for; 0.17.6 - 0.18.x drop the key
    cfg["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.1, "torch_adam": True}}
    params = [p for p in model.parameters() if p.requires_grad] if reference else model.parameters()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = engine(torch.randint(0, VOCAB, (MICRO, 8), generator=gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    moved = sorted(name for name, p in model.named_parameters()
                   if name in frozen and not torch.equal(p.detach(), frozen[name]))
    return {"losses": losses, "frozen_moved": moved, **param_digest(engine)}


def main():
    out, results = begin()
    for case in CASES:
        results[f"{case}/reference"] = attempt(train, case, reference=True)
        results[f"{case}/without"] = attempt(train, case)

    zeroshim = enable_zeroshim()
    # the reference steps as DeepSpeed does; without ZeRO patch muon_newton_schulz gives Muon's matrices Muon's
    # update (its own scenario proves that against Muon's reference implementation), which that step does not
    zeroshim.unpatch("muon_newton_schulz")

    results["status"] = zeroshim.status()["muon_frozen_params"].as_dict()
    for case in CASES:
        results[f"{case}/with"] = attempt(train, case)
        results[f"{case}/acted"] = zeroshim.stats("muon_frozen_params")["acted"]
    end(out, results)


if __name__ == "__main__":
    main()
