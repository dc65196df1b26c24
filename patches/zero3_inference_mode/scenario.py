"""Scenario for patch ``zero3_inference_mode``: a small MLP under ZeRO-3 on 2 ranks (fp32, SGD), trained for
``STEPS`` steps with an evaluation forward after each, as a training loop with evaluation or an RL loop computing
log-probabilities does.  Four cases (``CASES``):

* ``""``: ``stage3_param_persistence_threshold`` 0, the evaluation run as RL code runs it (no mode switch);
* ``"/eval"``: the same with ``engine.eval()`` before the evaluation and ``engine.train()`` after, as an evaluation
  loop does (DeepSpeed 0.14.1 keeps one coordinator per mode);
* ``"/default"``: DeepSpeed's default threshold (1e5 elements) with two layers above it (131,072 and 262,144);
* ``"/before"``: the default threshold, every parameter of the model below it (persistent), and ``BEFORE``
  evaluations before the first step (``eval_on_start``, a generation before training).

Runs: ``reference<case>``, the evaluations under ``torch.no_grad()`` (what TRL and ms-swift changed their code to);
``without<case>``, the evaluations under ``torch.inference_mode()`` without zeroshim (the training forward after the
evaluations fails: "Inference tensors cannot be saved for backward"); ``with<case>``, the same with zeroshim;
``healthy/with``, ``reference`` again with zeroshim (nothing to do: the same numbers, nothing counted).

Each run records its losses, a SHA-256 of each evaluation's output, a digest of this rank's parameter shards, and
after an evaluation (the most over them) how many parameters are gathered and how many of those hold inference
tensors.
``gather/without`` and ``gather/with`` gather every parameter of a new engine with ``GatheredParameters`` inside
``torch.inference_mode()`` and count the inference tensors there (``Init._all_gather``, which also serves a
parameter read by attribute outside its module).
"""

import hashlib

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

# the default threshold's persistent parameters take DeepSpeed's blocking gather after every step: on gloo before
# 0.19.8 it reads unwritten memory now and then (zero3_gloo_gather), which the runs without zeroshim would measure
deepspeed = import_deepspeed(fix_gloo_gathers=True)
NAME = "zero3_inference_mode"
STEPS, BEFORE = 3, 3
CASES = ("", "/eval", "/default", "/before")


def build(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _gathered(params) -> dict:
    """How many of ``params`` are gathered now, and how many of those hold inference tensors."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    available = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE]
    return {"available": len(available), "inference": sum(p.data.is_inference() for p in available)}


def loop(inference: bool, case: str) -> dict:
    model = build(8192 if case == "/default" else 32)  # "/default": the two wide layers are not persistent
    config = ds_config(3, micro_batch=2, bf16=False)
    if case in ("/default", "/before"):
        del config["zero_optimization"]["stage3_param_persistence_threshold"]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    probe = torch.randn(4, 16, generator=gen)
    losses, evaluations, after = [], [], {}

    def evaluate():
        if case == "/eval":
            engine.eval()
        with torch.inference_mode() if inference else torch.no_grad():
            out = engine(probe)
        if case == "/eval":
            engine.train()
        evaluations.append(hashlib.sha256(out.detach().contiguous().numpy().tobytes()).hexdigest()[:16])
        for key, count in _gathered(params).items():  # the most over the evaluations
            after[key] = max(after.get(key, 0), count)

    for _ in range(BEFORE if case == "/before" else 0):
        evaluate()
    for _ in range(STEPS):
        loss = engine(torch.randn(2, 16, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        evaluate()
    return {"losses": losses, "evaluations": evaluations, "after_evaluation": dict(after), **param_digest(engine)}


def gather() -> dict:
    """Every parameter gathered with ``GatheredParameters`` inside ``torch.inference_mode()`` (``Init._all_gather``):
    how many hold inference tensors there."""
    model = build(32)
    deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         config=ds_config(3, micro_batch=2, bf16=False))
    params = list(model.parameters())
    with torch.inference_mode(), deepspeed.zero.GatheredParameters(params):
        return {"params": len(params), "inference": sum(p.data.is_inference() for p in params)}


def main():
    out, results = begin()
    for case in CASES:
        results["reference" + case] = attempt(loop, False, case)
    for case in CASES:
        results["without" + case] = attempt(loop, True, case)
    results["gather/without"] = attempt(gather)
    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()[NAME].as_dict()
    results["healthy/with"] = attempt(loop, False, "")
    results["healthy/stats"] = zeroshim.stats(NAME)
    for case in CASES:
        results["with" + case] = attempt(loop, True, case)
    results["gather/with"] = attempt(gather)
    results["stats"] = zeroshim.stats(NAME)
    end(out, results)


if __name__ == "__main__":
    main()
