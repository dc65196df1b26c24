"""Scenario for patch ``trainer_auto_hidden_size``: HF Trainer (``TrainingArguments(deepspeed=<ZeRO-3 config>)``)
whose config leaves the three hidden-size-based entries ``"auto"``, on the tiny LLaVA of
``zeroshim/scenarios/tiny_llava.py`` (its ``LlavaConfig`` has ``text_config.hidden_size`` and no ``hidden_size``),
fp32, Trainer's AdamW (constant learning rate), 4 steps of 2 token sequences per rank in order, 2 ranks.

Runs, in one process per rank:

* ``reference``: the three values written by hand (256, 230, 160: ``hidden * hidden``, ``int(0.9 * hidden *
  hidden)``, ``10 * hidden`` for hidden 16), no zeroshim;
* ``text/without``: the Llama text model (top-level ``hidden_size``) with the "auto" entries, no zeroshim
  (Trainer fills them itself);
* ``without``: the LLaVA model with the "auto" entries, no zeroshim (transformers <= 4.45: "The model's config
  file has neither `hidden_size` nor `hidden_sizes` entry"; 4.46 and later fill them from ``text_config``);
* ``with``: the same with zeroshim (trains as the reference);
* ``explicit/with``, ``text/with``: the reference's config, and the text model, with zeroshim (nothing filled,
  the same numbers as without it);

plus ``filled`` (what the patch filled) and, per run, ``zero`` (the three values in the config the engine got).
"""

import os
import tempfile

import torch
import torch.distributed as dist

from common import attempt, begin, enable_zeroshim, end, import_deepspeed, param_digest

import_deepspeed(fix_gloo_gathers=True)  # ZeRO-3 gathers compared bit for bit (see common.import_deepspeed)
from tiny_llava import MICRO, SEQ, STEPS, VOCAB, build, ds_config  # noqa: E402

NAME = "trainer_auto_hidden_size"


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(100)
        self.ids = [torch.randint(0, VOCAB - 1, (SEQ,), generator=gen) for _ in range(STEPS * MICRO * 2)]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def in_order_trainer():
    """HF Trainer whose batches come in the dataset's order: its random sampler draws from the global generator,
    which the first engine of a process leaves elsewhere than later ones (runs are compared within one process)."""
    from transformers import Trainer

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder


def train(kind: str, auto: bool) -> dict:
    from transformers import TrainingArguments

    InOrder = in_order_trainer()

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # the last run's ZeRO-3 config: LLaVA's towers (from_config) would be partitioned
    model = build(kind)
    with tempfile.TemporaryDirectory() as scratch:
        holder = [scratch]
        dist.broadcast_object_list(holder, src=0)
        args = TrainingArguments(output_dir=os.path.join(holder[0], "run"), per_device_train_batch_size=MICRO,
                                 max_steps=STEPS, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                                 report_to=[], use_cpu=True, seed=0, deepspeed=ds_config(auto), disable_tqdm=True,
                                 dataloader_num_workers=0, optim="adamw_torch", lr_scheduler_type="constant")
        # Trainer's own optimizer: transformers <= 4.45 refuses optimizers= with DeepSpeed
        trainer = InOrder(model=model, args=args, train_dataset=Tokens())
        trainer.train()
        dist.barrier()
    zc = trainer.model_wrapped._config.zero_config  # what the engine runs with
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            **param_digest(trainer.model_wrapped),
            "zero": [zc.reduce_bucket_size, zc.prefetch_bucket_size, zc.param_persistence_threshold]}


def main():
    out, results = begin()
    results["reference"] = attempt(train, "llava", False)
    results["text/without"] = attempt(train, "text", True)
    results["without"] = attempt(train, "llava", True)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()[NAME].as_dict()
    results["with"] = attempt(train, "llava", True)
    filled_by_with = len(zeroshim.stats(NAME)["filled"])
    results["explicit/with"] = attempt(train, "llava", False)
    results["text/with"] = attempt(train, "text", True)
    results["filled"] = [list(f) for f in zeroshim.stats(NAME)["filled"]]
    results["filled_by_with"] = filled_by_with
    end(out, results)


if __name__ == "__main__":
    main()
