"""The judge of ``zero3_init_auto_batch`` (used by ``zeroshim prove`` and tests/test_zero3_init_auto_batch.py):
``deepspeed.zero.Init`` given a config with ``"auto"`` or no batch sizes (``from_pretrained`` under
``HfDeepSpeedConfig``, and ``zero.Init(config_dict_or_path=<file>)``)."""

from zeroshim._prove import failed_vs_equal, ranks_of

NAME = "zero3_init_auto_batch"
ARGS = ()
#: the cases DeepSpeed refuses for their batch sizes alone, which zeroshim lets through
ACTED = ("hf_auto", "hf_default", "hf_two", "hf_none", "raw_path", "train_only")


def acted(rank) -> tuple:
    """The cases zeroshim lets through on this DeepSpeed: ``hf_precision`` too where DeepSpeed reads ``"auto"``
    precision flags as off (>= 0.17.1)."""
    return ACTED + (("hf_precision",) if rank.get("precision_models") else ())


def judge(ranks):
    said_without, said_with, proven = None, None, True
    cases = acted(ranks[0])
    for case in cases:
        cased = [{"without": r["without"][case], "with": r["with"][case], "reference": r["reference"][case]}
                 for r in ranks]
        keys = ("sha256", "shapes", "losses") if case == "hf_auto" else ("sha256", "shapes")
        without, with_, ok = failed_vs_equal(cased, "without", "with", "reference", keys=keys, patch=NAME)
        proven = proven and ok and all(r["with"][case].get("user_config_kept") for r in ranks)
        if said_without is None:
            said_without, said_with = without, with_
    if proven:
        said_with = (f"loaded and trained; the ZeRO-3 shards (and the losses of two steps) equal those of the same "
                     "config with numbers for the batch sizes, bit for bit, in all "
                     f"{len(cases)} cases; the caller's config kept")
    return said_without, said_with, proven


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
