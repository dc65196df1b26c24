"""The judge of ``zero_auto_hidden_size`` (used by ``zeroshim prove`` and tests/test_zero_auto_hidden_size.py): a plain
accelerate loop, ZeRO-3 config with "auto" bucket sizes, a tiny LLaVA whose config has only ``text_config.hidden_size``.
``judge_runs`` also judges ``trainer_auto_hidden_size`` (the same runs, through HF Trainer)."""

from zeroshim._prove import equal, failed_vs_equal, ranks_of

NAME = "zero_auto_hidden_size"
ARGS = ()


def judge_runs(ranks, name: str):
    """The verdict on a hidden-size scenario's runs (``reference``, ``without``, ``with``, ``explicit/with``,
    ``text/without``, ``text/with``) for patch ``name``, whose signature the ``without`` error must show."""
    without, with_, proven = failed_vs_equal(ranks, "without", "with", "reference", patch=name)
    harmless = all(equal(r["explicit/with"], r["reference"]) and equal(r["text/with"], r["text/without"])
                   for r in ranks)
    if proven and not harmless:
        with_ = "filled and trained, but a config without \"auto\" or a text model trained differently with zeroshim"
    elif proven:
        with_ = ("trained; losses and parameters equal the config with the numbers written by hand bit for bit "
                 "(a text model and explicit numbers: unchanged)")
    return without, with_, proven and harmless


def judge(ranks):
    return judge_runs(ranks, NAME)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
