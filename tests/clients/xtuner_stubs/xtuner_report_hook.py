"""An mmengine hook the XTuner client configs list in ``custom_hooks`` (both arms: the config is the same).

After training, rank 0 writes ``OUT`` with, where zeroshim is active in the process, the patches
that applied and the counters of those whose action this run can trigger (they act in the rank
processes, which log nothing at INFO when they do: zero2_offload_accumulation, epoch_boundary).
Without zeroshim it writes ``{"zeroshim": false}``.
"""

import json
import sys

from mmengine.hooks import Hook

PATCHES = ("zero2_offload_accumulation", "offload_worker_fork", "epoch_boundary")


class ZeroshimReportHook(Hook):
    priority = "LOWEST"

    def __init__(self, out):
        self.out = out

    def after_run(self, runner):
        import torch.distributed as dist

        result = {"zeroshim": "zeroshim" in sys.modules}
        if result["zeroshim"]:
            zeroshim = sys.modules["zeroshim"]
            result["applied"] = sorted(n for n, s in zeroshim.status().items() if s.state == "applied")
            result["acted"] = {name: {k: v for k, v in zeroshim.stats(name).items() if isinstance(v, (int, float))}
                               for name in PATCHES}
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(self.out, "w") as fh:
                json.dump(result, fh)
