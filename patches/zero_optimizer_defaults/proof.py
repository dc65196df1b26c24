"""The judge of ``zero_optimizer_defaults`` (used by ``zeroshim prove`` and tests/test_zero_optimizer_defaults.py):
transformers' ``cosine_with_min_lr`` schedule with ``min_lr`` on DeepSpeed's optimizer, through the HF Trainer
(ZeRO-2) and through accelerate (ZeRO-3), 2 ranks."""

from zeroshim._prove import equal, ranks_of, shows_bug

NAME = "zero_optimizer_defaults"
ARGS = ()
PATHS = ("trainer", "accelerate")
KEYS = ("lrs", "losses", "param_sha256")


def judge(ranks):
    """Proven: on every rank, without zeroshim the accelerate path failed with the AttributeError (and the Trainer
    path failed alike or trained as the reference: transformers < 5.1 builds its schedule on its own optimizer);
    with zeroshim both paths trained, learning rates, losses and parameters equal to the reference (the same
    schedule written as ``min_lr_rate``, which reads nothing from the optimizer) bit for bit."""
    if not ranks or not all(r[f"{p}/reference"].get("ok") for r in ranks for p in PATHS):
        return "a reference run failed", "a reference run failed", False
    r0 = ranks[0]

    def failed(run):
        return not run.get("ok") and shows_bug(NAME, run.get("error"))

    broken = all(failed(r["accelerate/without"]) for r in ranks) and \
        all(failed(r["trainer/without"]) or equal(r["trainer/without"], r["trainer/reference"], KEYS) for r in ranks)
    fixed = all(r[f"{p}/with"].get("ok") and equal(r[f"{p}/with"], r[f"{p}/reference"], KEYS)
                for r in ranks for p in PATHS)
    trainer = "the Trainer too" if failed(r0["trainer/without"]) else "the Trainer trained (its own optimizer)"
    without = (f"{r0['accelerate/without']['error'].split(' @ ')[0]} ({trainer})" if broken
               else "the bug did not show")
    with_ = ("learning rates, losses and parameters equal the min_lr_rate schedule's bit for bit" if fixed
             else "differs from the reference, or failed")
    return without, with_, broken and fixed


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
