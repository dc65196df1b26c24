"""The judge of ``warmup_zero_steps`` (used by ``zeroshim prove`` and tests/test_warmup_zero_steps.py): DeepSpeed's
warmup schedulers from the config with ``warmup_num_steps`` 0 (and 3.0), ZeRO-2, 2 ranks."""

from zeroshim._prove import equal, ranks_of, shows_bug

NAME = "warmup_zero_steps"
ARGS = ()
CASES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "float")
KEYS = ("lrs", "losses", "param_sha256")


def judge(ranks):
    """Proven: on every rank, without zeroshim each scheduler refused its ``warmup_num_steps`` (DeepSpeed's
    ValueError); with zeroshim each trained, learning rates, losses and parameters equal to the run written with
    the value DeepSpeed <= 0.19.2 scheduled alike (1 for 0, 3 for 3.0) bit for bit."""
    if not ranks or not all(r[f"{c}/reference"].get("ok") for r in ranks for c in CASES):
        return "a reference run failed", "a reference run failed", False
    r0 = ranks[0]
    broken = all(not r[f"{c}/without"].get("ok") and shows_bug(NAME, r[f"{c}/without"].get("error"))
                 for r in ranks for c in CASES)
    fixed = all(r[f"{c}/with"].get("ok") and equal(r[f"{c}/with"], r[f"{c}/reference"], KEYS)
                for r in ranks for c in CASES)
    without = (f"{r0['WarmupLR/without']['error'].split(' @ ')[0]} (and WarmupDecayLR, WarmupCosineLR, 3.0)"
               if broken else "the bug did not show")
    with_ = ("every scheduler trained; learning rates, losses and parameters equal the run with 1 (3) bit for bit"
             if fixed else "differs from the reference, or failed")
    return without, with_, broken and fixed


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
