"""Scenario for patch ``zero3_inference_mode``: a small MLP under ZeRO-3 on 2 ranks (fp32, SGD), trained for
``STEPS`` steps with an evaluation forward after each, as a training loop with evaluation or an RL loop computing
log-probabilities does.

* ``reference``: the evaluations under ``torch.no_grad()`` (what TRL and ms-swift changed their code to), with
  ``stage3_param_persistence_threshold`` 0;
* ``reference/default``: the same with DeepSpeed's default threshold (1e5 elements: persistent parameters are
  gathered once, outside any evaluation) and two layers above it (131,072 and 262,144 elements);
* ``without``, ``without/default``: the evaluations under ``torch.inference_mode()``, no zeroshim: the training
  forward after the first evaluation fails ("Inference tensors cannot be saved for backward");
* ``with``, ``with/default``: the same with zeroshim;
* ``healthy/with``: ``reference`` again with zeroshim (nothing to do: the same numbers, nothing counted).

Each run records its losses, a SHA-256 of each evaluation's output and a digest of this rank's parameter shards.
"""

import hashlib

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
NAME = "zero3_inference_mode"
STEPS = 3


def build(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def loop(inference: bool, default_threshold: bool = False) -> dict:
    model = build(8192 if default_threshold else 32)  # default threshold: the two wide layers are not persistent
    config = ds_config(3, micro_batch=2, bf16=False)
    if default_threshold:
        del config["zero_optimization"]["stage3_param_persistence_threshold"]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    probe = torch.randn(4, 16, generator=gen)
    losses, evaluations = [], []

    def evaluate():
        with torch.inference_mode() if inference else torch.no_grad():
            out = engine(probe)
        evaluations.append(hashlib.sha256(out.detach().contiguous().numpy().tobytes()).hexdigest()[:16])

    for _ in range(STEPS):
        loss = engine(torch.randn(2, 16, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        evaluate()
    return {"losses": losses, "evaluations": evaluations, **param_digest(engine)}


def main():
    out, results = begin()
    results["reference"] = attempt(loop, False)
    results["reference/default"] = attempt(loop, False, True)
    results["without"] = attempt(loop, True)
    results["without/default"] = attempt(loop, True, True)
    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()[NAME].as_dict()
    results["healthy/with"] = attempt(loop, False)
    results["healthy/stats"] = zeroshim.stats(NAME)
    results["with"] = attempt(loop, True)
    results["with/default"] = attempt(loop, True, True)
    results["stats"] = zeroshim.stats(NAME)
    end(out, results)


if __name__ == "__main__":
    main()
