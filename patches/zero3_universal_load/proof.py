"""The judge of ``zero3_universal_load`` (used by ``zeroshim prove`` and tests/test_zero3_universal_load.py): ZeRO-3
with two parameter groups resumed from its universal checkpoint against the same run resumed from its ordinary one,
2 ranks."""

from zeroshim._prove import equal, ranks_of

NAME = "zero3_universal_load"
ARGS = ()
KEYS = ("losses", "steps_final", "weight_decays", "param_sha256")


def judge(ranks):
    """Proven: without zeroshim the universal resume has other param-group settings and step counts than the
    ordinary resume (the reference) and trains to other parameters, on every rank; with zeroshim it equals it bit for
    bit (losses, steps, weight decays, parameter shards); the ordinary resume, and a single group's universal resume,
    are unchanged."""
    runs = ("plain/without", "universal/without", "plain/with", "universal/with", "single/universal/without",
            "single/universal/with")
    if len(ranks) < 2 or not all(r and r[k].get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    wrong = all(not equal(r["universal/without"], r["plain/without"], KEYS) for r in ranks)
    fixed = all(equal(r["universal/with"], r["plain/without"], KEYS) for r in ranks)
    harmless = all(equal(r["plain/with"], r["plain/without"], KEYS) and
                   equal(r["single/universal/with"], r["single/universal/without"], KEYS) for r in ranks)
    steps = ranks[0]["universal/without"]["steps_final"]
    decays = ranks[0]["universal/without"]["weight_decays"]
    without = (f"the universal resume had weight decays {decays} and counted its steps to {steps} where the ordinary "
               f"one has {ranks[0]['plain/without']['weight_decays']} and {ranks[0]['plain/without']['steps_final']}, "
               "and trained to other parameters" if wrong
               else "the universal resume trained as the ordinary one: the bug did not show")
    with_ = ("the universal resume equals the ordinary one bit for bit" if fixed
             else "the universal resume differs from the ordinary one") + ("" if harmless else
                                                                           "; a run that was right changed")
    return without, with_, wrong and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
