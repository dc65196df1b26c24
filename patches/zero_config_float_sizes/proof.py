"""The judge of ``zero_config_float_sizes`` (used by ``zeroshim prove`` and tests/test_zero_config_float_sizes.py):
``zero_optimization`` sizes computed as floats (``0.9 * hidden * hidden``), ZeRO-3 and ZeRO-2."""

from zeroshim._prove import equal, failed_vs_equal, ranks_of

NAME = "zero_config_float_sizes"
ARGS = ()


def judge(ranks):
    without, with_, proven = failed_vs_equal(ranks, "without", "with", "reference", patch=NAME)
    z2 = all(not r["z2/without"]["ok"] for r in ranks) and all(equal(r["z2/with"], r["z2/reference"]) for r in ranks)
    if proven:
        with_ = ("trained; losses and parameters equal the config written with the rounded integers bit for bit "
                 "(ZeRO-3" + (" and ZeRO-2)" if z2 else "; ZeRO-2 did not match)"))
    return without, with_, proven and z2


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
