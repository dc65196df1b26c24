"""The judge of ``accelerate_accumulation_boundary`` (used by ``zeroshim prove`` and
tests/test_accelerate_accumulation_boundary.py): accumulation through accelerate on a DeepSpeed engine with a window
cut short at each epoch's end, through the HF Trainer (ZeRO-2) and ``accelerator.accumulate`` (ZeRO-1), 2 ranks."""

from zeroshim._prove import equal, ranks_of, shows_bug

NAME = "accelerate_accumulation_boundary"
ARGS = ()
PATHS = ("trainer", "accumulate")
KEYS = ("counted", "stepped", "losses", "param_sha256")


def drifted(run) -> bool:
    """Trained, and DeepSpeed took other optimizer steps than accelerate (or the Trainer) counted."""
    return bool(run.get("ok")) and run["counted"] != run["stepped"]


def in_step(run) -> bool:
    return bool(run.get("ok")) and run["counted"] == run["stepped"]


def judge(ranks):
    """Proven: on every rank, without zeroshim the Trainer run drifted (DeepSpeed stepped otherwise than the Trainer
    counted) and the accumulate loop drifted or failed with the no_sync error; with zeroshim both took the steps
    counted, equal bit for bit to the by-hand remedy (accelerate 1.8.0's backward, with zeroshim less this patch);
    the run whose windows are all whole and the runs left to DeepSpeed (even_batches=False; accelerate's accumulation
    left at 1 under DeepSpeed's 2; a loop without accumulate, also after another loop in the
    same process) equal zeroshim less this patch bit for bit."""
    if not ranks or not all(r[key].get("ok") for r in ranks
                            for key in ("trainer/reference", "accumulate/reference", "trainer/off", "whole/off")):
        return "a reference run failed", "a reference run failed", False
    r0 = ranks[0]

    def broken(run):
        return drifted(run) or (not run.get("ok") and shows_bug(NAME, run.get("error")))

    bug = all(drifted(r["trainer/without"]) and broken(r["accumulate/without"]) for r in ranks)
    fixed = all(in_step(r[f"{p}/with"]) and equal(r[f"{p}/with"], r[f"{p}/reference"], KEYS)
                for r in ranks for p in PATHS)
    kept = all(equal(r["whole/with"], r["whole/off"], KEYS) and equal(r["uneven/with"], r["trainer/off"], KEYS)
               and equal(r["dsga/with"], r["dsga/off"], KEYS) and equal(r["noacc/with"], r["noacc/off"], KEYS)
               and equal(r["stale/with"], r["stale/off"], KEYS)
               for r in ranks)
    t = r0["trainer/without"]
    if bug:
        acc = r0["accumulate/without"]
        rest = (acc["error"].split(" @ ")[0] if not acc.get("ok")
                else f"accumulate: {acc['counted']} counted, {acc['stepped']} taken")
        without = f"the Trainer counted {t['counted']} optimizer steps, DeepSpeed took {t['stepped']}; {rest}"
    else:
        without = "the bug did not show (DeepSpeed stepped where accelerate counted)"
    if fixed and kept:
        with_ = (f"DeepSpeed took the {r0['trainer/with']['stepped']} steps the Trainer counted; both paths equal the "
                 "by-hand remedy bit for bit; whole windows and the runs left to DeepSpeed unchanged")
    elif fixed:
        with_ = "the cut windows matched, but a run that must not change changed"
    else:
        with_ = "differs from the by-hand remedy, or failed"
    return without, with_, bug and fixed and kept


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
