"""The judge of ``muon_zero_supported`` (used by ``zeroshim prove`` and tests/test_muon_zero_supported.py):
DeepSpeed's Muon optimizer from the config under ZeRO-1 and ZeRO-2, without ``zero_allow_untested_optimizer``."""

from zeroshim._prove import equal, ranks_of

NAME = "muon_zero_supported"
ARGS = ()
STAGES = ("zero1", "zero2")
REFUSED = "You are using an untested ZeRO Optimizer"


def judge(ranks):
    """Proven: on every rank and stage, without zeroshim DeepSpeed refused its own Muon optimizer ("untested ZeRO
    Optimizer"); with zeroshim the run equals the reference (the config with ``zero_allow_untested_optimizer``)
    bit for bit, losses and parameters; and the reference's config with zeroshim is the reference's run."""
    runs = [f"{stage}/{arm}" for stage in STAGES for arm in ("reference", "with", "allowed/with")]
    if not ranks or not all(r[k].get("ok") for r in ranks for k in runs):
        failed = sorted({k for r in ranks for k in runs if not r[k].get("ok")})
        return f"a run failed: {failed}", f"a run failed: {failed}", False
    refused = all(not r[f"{s}/without"]["ok"] and REFUSED in r[f"{s}/without"]["error"] for r in ranks for s in STAGES)
    fixed = all(equal(r[f"{s}/with"], r[f"{s}/reference"]) for r in ranks for s in STAGES)
    harmless = all(equal(r[f"{s}/allowed/with"], r[f"{s}/reference"]) for r in ranks for s in STAGES)
    first = ranks[0]["zero2/without"]
    without = (f"ZeRO-1 and ZeRO-2 refused DeepSpeed's own Muon optimizer: {REFUSED}" if refused else
               f"ZeRO-2: {first.get('error') or 'trained'}")
    with_ = ("both train as the reference (zero_allow_untested_optimizer set), losses and parameters bit for bit"
             if fixed else "differs from the reference") + ("" if harmless else "; the reference's config changed")
    return without, with_, refused and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
