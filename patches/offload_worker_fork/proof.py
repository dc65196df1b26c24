"""The judge of ``offload_worker_fork`` (used by ``zeroshim prove`` and tests/test_offload_worker_fork.py):
ZeRO-3 with optimizer offload, a DataLoader worker re-forked at epoch 2; host memory by PSS."""

import os

from zeroshim._prove import ranks_of

NAME = "offload_worker_fork"
CONFIGS = ("none", "workers", "workers+zeroshim")
ARGS = ("--layers", "12", "--width", "1024")


def growth(ranks) -> float:
    """PSS growth (MB) from after initialisation to the end of the last epoch, summed over the ranks."""
    return sum(r["run"]["pss_epoch_last"][-1] - r["run"]["pss_after_init"] for r in ranks)


def judge(runs):
    """``runs``: config -> ranks, for each of :data:`CONFIGS`."""
    state = sum(r["run"]["state_mb"] for r in runs["none"])
    none, workers, patched = growth(runs["none"]), growth(runs["workers"]), growth(runs["workers+zeroshim"])
    same = all(a["run"]["losses"] == b["run"]["losses"] for a, b in zip(runs["workers+zeroshim"], runs["none"]))
    return (f"+{workers:.0f} MB in epoch 2 with a DataLoader worker vs +{none:.0f} MB without "
            f"(PSS, {len(runs['none'])} ranks)",
            f"+{patched:.0f} MB with the worker; losses {'identical' if same else 'DIFFERENT'}",
            workers - none > 0.5 * state and patched - none <= 0.25 * (workers - none) and same)


def prove(launch, out, nproc, device):
    return judge({c: ranks_of(launch(NAME, nproc, os.path.join(out, c.replace("+", "_")), "--config", c, *ARGS))
                  for c in CONFIGS})
