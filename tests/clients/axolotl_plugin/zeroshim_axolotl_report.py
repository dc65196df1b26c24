"""An axolotl plugin the axolotl client configs list in ``plugins:`` (both arms: the config is the same).

axolotl's own extension point (``axolotl.integrations.base.BasePlugin``,
``add_callbacks_post_trainer``) adds a ``TrainerCallback`` that, at the end of training, has rank 0
write ``<output_dir>/zeroshim_report.json``: the Trainer's full-precision losses (``log_history``;
stdout rounds them to 4 digits and axolotl never calls ``save_state``), whether DeepSpeed ran, the
``gradient_checkpointing_kwargs`` the Trainer got, and, where zeroshim is active in the rank,
the patches that applied and the counters of those whose action is only counted (they act inside
the ranks and log nothing at INFO: nonreentrant_checkpoint, zero3_delegating_wrapper, ...).
"""

import json
import os
import sys

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

PATCHES = ("nonreentrant_checkpoint", "zero3_frozen_recompute", "zero3_delegating_wrapper",
           "zero3_hf_config_weakref", "scheduler_dropped_groups", "zero3_peft_save", "zero3_gloo_gather")


class _Report(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        import torch.distributed as dist

        result = {"losses": [h["loss"] for h in state.log_history if "loss" in h],
                  "log_history": state.log_history,
                  "deepspeed": bool(getattr(self.trainer, "is_deepspeed_enabled", False)),
                  "gradient_checkpointing_kwargs": args.gradient_checkpointing_kwargs,
                  "zeroshim": "zeroshim" in sys.modules}
        if result["zeroshim"]:
            zeroshim = sys.modules["zeroshim"]
            result["applied"] = sorted(n for n, s in zeroshim.status().items() if s.state == "applied")
            result["states"] = {n: s.state for n, s in zeroshim.status().items() if n in PATCHES}
            result["counters"] = {name: {k: v for k, v in zeroshim.stats(name).items() if isinstance(v, (int, float))}
                                  for name in PATCHES if name in result["applied"]}
        # who will write the model at the end (transformers' should_save, accelerate's is_main_process)
        mine = {"rank": dist.get_rank() if dist.is_initialized() else 0, "process_index": args.process_index,
                "should_save": args.should_save, "is_main_process": self.trainer.accelerator.is_main_process,
                "distributed_type": str(self.trainer.accelerator.distributed_type),
                "losses": [h["loss"] for h in state.log_history if "loss" in h]}
        ranks = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        result["ranks"] = ranks
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(os.path.join(args.output_dir, "zeroshim_report.json"), "w") as fh:
                json.dump(result, fh)


class ZeroshimReport(BasePlugin):
    def add_callbacks_post_trainer(self, cfg, trainer):
        return [_Report(trainer)]
