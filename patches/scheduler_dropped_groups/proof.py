"""The judge of patch ``scheduler_dropped_groups`` (shared by its test and ``zeroshim prove``).

Proven when, on every rank:

* without zeroshim, every ``deepspeed.initialize`` case (``raw_z2``, ``raw_z3``: a scheduler made by the
  user, any transformers) shows the bug: the patch's error signature (torch >= 2.10), or, where torch's
  zip is not strict, it trains with LRs other than the reference's (the kept group given the removed
  group's schedule);
* with zeroshim, every case (HF Trainer and ``deepspeed.initialize``, ZeRO-2 and ZeRO-3) trains to the
  reference's per-step LRs, losses and parameters bit for bit (the reference: the empty group never
  existed), and the raw cases' scheduler states equal the reference's;
* the full fine-tune (no empty group) is the same with and without zeroshim, bit for bit, and zeroshim
  did nothing there.

The HF Trainer cases without zeroshim fail only where transformers builds its scheduler before
``deepspeed.initialize`` (< 5.1); elsewhere they train, equal to the reference, and the judge says so.
"""

import re

NAME = "scheduler_dropped_groups"
ARGS = ()
TRAINER, RAW = ("trainer_z2", "trainer_z3"), ("raw_z2", "raw_z3")
KEYS = ("losses", "lrs", "param_sha256")


def _signature():
    from zeroshim.patches.scheduler_dropped_groups import PATCH

    return PATCH.signatures[0]


def shows_bug(run: dict) -> bool:
    """The run failed with the patch's error signature (the message and torch's scheduler frame)."""
    return not run.get("ok") and all(re.search(p, run.get("error") or "") for p in _signature())


def equal(run: dict, reference: dict, keys=KEYS) -> bool:
    """``zeroshim._prove.equal`` over this scenario's numbers (losses, per-step LRs, parameters)."""
    from zeroshim._prove import equal as same

    return same(run, reference, keys)


def _bug_without(rank: dict, case: str) -> bool:
    run, reference = rank["without"][case], rank["reference"][case]
    if shows_bug(run):
        return True
    return bool(run.get("ok")) and bool(reference.get("ok")) and run.get("lrs") != reference.get("lrs")


def _said(rank: dict, case: str) -> str:
    run, reference = rank["without"][case], rank["reference"][case]
    if shows_bug(run):
        message = (run["error"] or "").partition(" @ ")[0]
        return message.strip()
    if not run.get("ok"):
        return f"failed otherwise: {(run.get('error') or '')[:90]}"
    if run.get("lrs") != reference.get("lrs"):
        return "trained with the wrong learning rates"
    return "trained (the bug did not show)"


def judge(ranks) -> "tuple[str, str, bool]":
    if not ranks or None in ranks:
        return "no results", "no results", False
    first = ranks[0]
    shown = all(_bug_without(rank, case) for rank in ranks for case in RAW)
    fixed = all(equal(rank["with"][c], rank["reference"][c]) for rank in ranks for c in TRAINER + RAW) and \
        all(rank["with"][c].get("state") == rank["reference"][c].get("state") for rank in ranks for c in RAW)
    harmless = all(equal(rank["harmless"]["with"], rank["harmless"]["without"], ("losses", "param_sha256"))
                   and not any(rank["harmless"].get("stats", {}).values()) for rank in ranks)
    said_without = "; ".join(f"{case}: {_said(first, case)}" for case in TRAINER + RAW)
    if fixed and harmless:
        said_with = ("trained; LRs per step, losses and parameters equal the run without the empty group, bit for "
                     "bit (ZeRO-2 and ZeRO-3, HF Trainer and deepspeed.initialize); a full fine-tune unchanged")
    elif not fixed:
        bad = [c for c in TRAINER + RAW if not equal(first["with"][c], first["reference"][c])]
        said_with = f"differs from the reference in {', '.join(bad) or 'the scheduler state'}: " \
                    f"{(first['with'][bad[0]].get('error') or 'numbers differ')[:90] if bad else ''}"
    else:
        said_with = "the full fine-tune differs with zeroshim (or the patch acted there)"
    return said_without, said_with, shown and fixed and harmless


def prove(launch, out, nproc, device):
    from zeroshim._prove import ranks_of

    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
