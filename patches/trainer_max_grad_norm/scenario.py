"""Scenario for patch ``trainer_max_grad_norm``: the HF Trainer with ``max_grad_norm=0.05`` and a ZeRO-2 config
without a ``gradient_clipping`` key.  A 16 -> 32 -> 4 MLP, fp32, 2 ranks, 4 steps, learning rate 1e-2.

Runs, in one process per rank:

* ``reference``: the config with ``"gradient_clipping": "auto"`` (transformers fills in 0.05);
* ``without``: no key, no zeroshim (DeepSpeed clips at its own default: 0, none, before 0.19.3; 1.0 from 0.19.3);
* ``with``: no key, with zeroshim: clipped at 0.05, equal to the reference bit for bit;
* ``default/without``, ``default/with``: no key and ``max_grad_norm`` equal to DeepSpeed's default: nothing to
  change, the two runs must be equal bit for bit (the patch does not act).

Each run records the clipping DeepSpeed was configured with, the logged losses and gradient norms and a digest of
the parameters.
"""

import tempfile

import torch

from common import attempt, begin, enable_zeroshim, end, import_deepspeed, param_digest
from tiny_mlp import H, Net, Rows

deepspeed = import_deepspeed()
MICRO, STEPS, NORM = 2, 4, 0.05


def train(max_grad_norm: float, key: bool) -> dict:
    from transformers import Trainer, TrainingArguments

    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
           "fp16": {"enabled": False}, "bf16": {"enabled": False}}
    if key:
        cfg["gradient_clipping"] = "auto"
    world = torch.distributed.get_world_size()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO, max_steps=STEPS,
                                 learning_rate=1e-2, max_grad_norm=max_grad_norm, logging_steps=1, save_strategy="no",
                                 report_to=[], use_cpu=True, seed=0, deepspeed=cfg, disable_tqdm=True,
                                 dataloader_num_workers=0)
        run = Trainer(model=Net(), args=args, train_dataset=Rows(MICRO * world * STEPS))
        run.train()
        logs = [h for h in run.state.log_history if "loss" in h]
        return {"clipping": run.model_wrapped.gradient_clipping(), "losses": [h["loss"] for h in logs],
                "grad_norms": [float(h.get("grad_norm", -1)) for h in logs], **param_digest(run.model_wrapped)}


def main():
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    out, results = begin()
    results["deepspeed_default"] = GRADIENT_CLIPPING_DEFAULT
    results["reference"] = attempt(train, NORM, True)
    results["without"] = attempt(train, NORM, False)
    results["default/without"] = attempt(train, float(GRADIENT_CLIPPING_DEFAULT), False)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["trainer_max_grad_norm"].as_dict()
    results["with"] = attempt(train, NORM, False)
    results["default/with"] = attempt(train, float(GRADIENT_CLIPPING_DEFAULT), False)
    results["stats"] = dict(zeroshim.stats("trainer_max_grad_norm"))
    end(out, results)


if __name__ == "__main__":
    main()
