"""Scenario for patch ``muon_newton_schulz``: DeepSpeed's Muon optimizer from the config (``lr`` 0.02, ``momentum``
0.95, ``weight_decay`` 0.1) on three bias-free linear layers (16 x 16, 16 x 16, 16 -> 8: every parameter a Muon
matrix), a mean-squared error, 2 ranks, 3 steps.

Cases, in one process per rank:

* ``zero0/fp32``, ``zero0/bf16``: no ZeRO, fp32 (the engine steps ``MuonWithAuxAdam`` itself) and bf16 (through
  ``FP16_UnfusedOptimizer``), each run ``reference`` (DeepSpeed's own ``SingleDeviceMuon`` from
  ``original_muon.py``, the Muon reference implementation it ships, passed as a client optimizer with the same
  hyperparameters), ``without`` (the config, no zeroshim: DeepSpeed 0.17.6 - 0.19.6 step the raw gradient) and
  ``with`` (zeroshim: as the reference);
* ``zero2/fp32``: ZeRO-2, ``without`` and ``with``: ZeRO computes Muon's update on its flat partitions, so the
  runs must be equal bit for bit and the patch must not act.

Each run records the losses, a digest of the parameters and the optimizer wrapper's type.
"""

import torch
import torch._dynamo
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
# DeepSpeed >= 0.18.3 compiles Muon's kernels with torch.compile on their first call; every run here runs them
# eagerly alike
torch._dynamo.config.disable = True
H, OUT, STEPS, MICRO = 16, 8, 3, 4
LR, MOMENTUM, DECAY = 0.02, 0.95, 0.1
CASES = {"zero0/fp32": (0, False), "zero0/bf16": (0, True), "zero2/fp32": (2, False)}


class Mats(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.fc3 = nn.Linear(H, OUT, bias=False)

    def forward(self, x, y):
        out = self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))
        return nn.functional.mse_loss(out.float(), y)


def train(case: str, reference: bool = False) -> dict:
    stage, bf16 = CASES[case]
    torch.manual_seed(0)
    model = Mats()
    cfg = ds_config(stage, micro_batch=MICRO, bf16=bf16)
    if reference:
        from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuon

        optimizer = SingleDeviceMuon(model.parameters(), lr=LR, weight_decay=DECAY, momentum=MOMENTUM)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    else:
        # torch_adam: DeepSpeed >= 0.19 would build FusedAdam's C++ op for an Adam group (there is none here);
        # 0.17.6 - 0.18.x drop the key
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": LR, "momentum": MOMENTUM, "weight_decay": DECAY,
                                                       "torch_adam": True}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    dtype = torch.bfloat16 if bf16 else torch.float32
    losses = []
    for _ in range(STEPS):
        x = torch.randn(MICRO, H, generator=gen).to(dtype)
        loss = engine(x, torch.randn(MICRO, OUT, generator=gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "wrapper": type(engine.optimizer).__name__, **param_digest(engine)}


def main():
    out, results = begin()
    for case in CASES:
        if case.startswith("zero0"):
            results[f"{case}/reference"] = attempt(train, case, reference=True)
        results[f"{case}/without"] = attempt(train, case)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["muon_newton_schulz"].as_dict()
    for case in CASES:
        results[f"{case}/with"] = attempt(train, case)
        results[f"{case}/acted"] = zeroshim.stats("muon_newton_schulz")["acted"]
    end(out, results)


if __name__ == "__main__":
    main()
