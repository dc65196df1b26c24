"""HF Trainer + peft LoRA + gradient checkpointing + DeepSpeed ZeRO-3 (patch
``zero3_frozen_recompute``, with ``nonreentrant_checkpoint``).

The model of patches/zero3_frozen_recompute/scenario.py (tiny Llama, LoRA on q_proj/v_proj),
2 epochs.  Modes:

* ``--reference``: no zeroshim, no gradient checkpointing;
* ``--without``: no zeroshim, ``use_reentrant=False``;
* ``--zeroshim``: zeroshim imported first, gradient checkpointing with
  transformers' own default (reentrant before 5.x, which zeroshim turns into
  non-reentrant under ZeRO; non-reentrant from 5.x).
"""

import sys

if "--zeroshim" in sys.argv:
    import zeroshim  # noqa: F401  (first, before torch)

import argparse

import torch

from common import attempt, end, import_deepspeed, init_distributed, train_with_trainer, trainer_ds_config, versions
from tiny_lora import SEQ, VOCAB, build_model

import_deepspeed()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(11))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(checkpointing: bool, kwargs) -> dict:
    model = build_model(trainer_ds_config(), zero_init=False)
    model.enable_input_require_grads()  # what peft users do for checkpointing with frozen embeddings

    def optimizers(args):
        # Our own optimizer and scheduler, made before DeepSpeed sees them.  With
        # Trainer's defaults, LoRA-only training leaves Trainer's no-decay group
        # empty; ZeRO-3 drops it after the scheduler has recorded two base LRs,
        # and torch 2.13's LR scheduler (zip strict) then fails at the first step,
        # with or without checkpointing and zeroshim.
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    return train_with_trainer(model, Tokens(), checkpointing, kwargs, optimizers)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--zeroshim", action="store_true")
    mode.add_argument("--without", action="store_true")
    mode.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    init_distributed()
    if args.reference:
        checkpointing, kwargs = False, None
    elif args.without:
        checkpointing, kwargs = True, {"use_reentrant": False}
    else:
        checkpointing, kwargs = True, None  # transformers' default
    results = {"versions": versions(), "run": attempt(train, checkpointing, kwargs)}
    if args.zeroshim:
        results["status"] = {k: v.as_dict() for k, v in zeroshim.status().items()}
    end(args.out, results)


if __name__ == "__main__":
    main()
