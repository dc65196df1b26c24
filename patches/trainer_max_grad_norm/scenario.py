"""Scenario for patch ``trainer_max_grad_norm``: the HF Trainer with ``max_grad_norm=0.05`` and a ZeRO-2 config
without a ``gradient_clipping`` key.  A 16 -> 32 -> 4 MLP, fp32, 2 ranks, 4 steps, learning rate 1e-2.

Runs, in one process per rank:

* ``reference``: the config with ``"gradient_clipping": "auto"`` (transformers fills in 0.05);
* ``without``: no key, no zeroshim (DeepSpeed clips at its own default: 0, none, before 0.19.3; 1.0 from 0.19.3);
* ``with``: no key, with zeroshim: clipped at 0.05, equal to the reference bit for bit;
* ``default/without``, ``default/with``: no key and ``max_grad_norm`` equal to DeepSpeed's default: nothing to
  change, the two runs must be equal bit for bit (the patch does not act).

And a plain accelerate loop (``Accelerator`` with a ZeRO-2 ``DeepSpeedPlugin`` whose config says
``"gradient_clipping": 1.0``, ``accelerator.clip_grad_norm_(parameters, 0.05)`` after each backward):

* ``accelerate/reference``: the config says 0.05;
* ``accelerate/without``, ``accelerate/with``: the config says 1.0, without and with zeroshim: DeepSpeed clips at
  1.0 (``clip_grad_norm_`` does nothing under DeepSpeed); the two runs must be equal bit for bit, and only the one
  with zeroshim says so (``said``: zeroshim's WARNINGs about it).

Each run records the clipping DeepSpeed was configured with, the logged losses and gradient norms and a digest of
the parameters.
"""

import tempfile

import torch

from common import Said, attempt, begin, enable_zeroshim, end, import_deepspeed, param_digest
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


SAID = Said()


def accelerate_loop(config_clipping: float) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)  # one Accelerator per run (accelerate keeps its state in singletons)
    GradientState._reset_state()
    said_before = len(SAID.about("clip_grad_norm_"))  # this run's own
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 2},
           "gradient_clipping": config_clipping, "bf16": {"enabled": False}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(Rows(MICRO * torch.distributed.get_world_size() * STEPS), batch_size=MICRO)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms = [], []
    for batch in loader:
        loss = engine(batch["x"])["loss"]
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(engine.parameters(), NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"clipping": engine.gradient_clipping(), "losses": losses, "grad_norms": norms,
            "said": SAID.about("clip_grad_norm_")[said_before:], **param_digest(engine)}


def main():
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    out, results = begin()
    results["deepspeed_default"] = GRADIENT_CLIPPING_DEFAULT
    results["reference"] = attempt(train, NORM, True)
    results["without"] = attempt(train, NORM, False)
    results["default/without"] = attempt(train, float(GRADIENT_CLIPPING_DEFAULT), False)
    results["accelerate/reference"] = attempt(accelerate_loop, NORM)
    results["accelerate/without"] = attempt(accelerate_loop, 1.0)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["trainer_max_grad_norm"].as_dict()
    results["with"] = attempt(train, NORM, False)
    results["default/with"] = attempt(train, float(GRADIENT_CLIPPING_DEFAULT), False)
    told_by_trainer = zeroshim.stats("trainer_max_grad_norm")["told"]
    results["accelerate/with"] = attempt(accelerate_loop, 1.0)
    results["told_by_trainer"] = told_by_trainer
    results["stats"] = dict(zeroshim.stats("trainer_max_grad_norm"))
    end(out, results)


if __name__ == "__main__":
    main()
