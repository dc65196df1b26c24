"""The judge of ``zero3_generate_sync`` (used by ``zeroshim prove`` and tests/test_zero3_generate_sync.py):
``generate()`` under ZeRO-3 on 2 ranks that stop at different lengths."""

import os

from zeroshim._prove import Unproven, ranks_of

NAME = "zero3_generate_sync"


def judge(runs):
    """``runs``: ``{"without": ranks, "with": ranks}``."""
    hung = any(r["tokens"] == "hang" for r in runs["without"])
    done = all(r["tokens"] == r["reference"] for r in runs["with"])
    return ("hung (no rank returned within 30 s after another finished)" if hung else "finished (no hang)",
            "finished; tokens equal the unpartitioned model's" if done else "hung or other tokens", hung and done)


def prove(launch, out, nproc, device):
    if nproc < 2:
        raise Unproven("needs 2 ranks or more (ranks that stop at different lengths)")
    return judge({mode: ranks_of(launch(NAME, nproc, os.path.join(out, mode), "--mode", mode, "--timeout", timeout))
                  for mode, timeout in (("without", "30"), ("with", "120"))})
