"""The judge of ``stale_build_lock`` (used by ``zeroshim prove`` and tests/test_stale_build_lock.py): DeepSpeed's
JIT build of its CPU comm op (the fused Adam on DeepSpeed 0.14) on 2 ranks, into a folder where a killed build
left torch's lock.

Proven: without zeroshim every rank is still waiting in torch's ``FileBaton.wait`` after the time limit; with
zeroshim one rank removed the lock, the op was built and loads on every rank; and a lock a live process holds
(as a build in progress does) is waited on and never removed."""

import os

from zeroshim._prove import ranks_of

NAME = "stale_build_lock"
HANG_S = "10"


def judge(runs):
    """``runs``: ``{"stale": ranks, "held": ranks}`` (the two launches of the scenario, in that order)."""
    stale, held = runs["stale"], runs["held"]
    hung = all(r["without"]["hang"] and r["without"]["stack"][0].startswith("wait (file_baton.py)") for r in stale)
    built = (all(r["with"]["ok"] for r in stale) and sum(r["with"]["stats"]["removed"] for r in stale) == 1)
    waited = all(r["held"]["ok"] and r["held"]["stats"]["removed"] == 0 for r in held)
    said_without = (f"every rank still waiting on the lock after {stale[0]['without']['waited']:.0f} s (FileBaton.wait)"
                    if hung else "did not hang")
    said_with = ("one rank removed the stale lock; the op built and loaded on every rank; a held lock was waited "
                 "on, not removed" if built and waited else
                 f"not as expected: {[r['with'] for r in stale]} {[r['held'] for r in held]}")
    return said_without, said_with, bool(hung and built and waited)


def prove(launch, out, nproc, device):
    # the held launch waits over the folder the stale launch built into: one --extensions for both
    extensions = os.path.join(out, "extensions")
    return judge({mode: ranks_of(launch(NAME, nproc, os.path.join(out, mode), "--mode", mode, "--hang", HANG_S,
                                        "--extensions", extensions))
                  for mode in ("stale", "held")})
