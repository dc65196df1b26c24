"""The judge of ``zero3_inflight_params`` (used by ``zeroshim prove`` and tests/test_zero3_inflight_params.py): a
ZeRO-3 model whose modules change between steps -- a branch skipped on odd steps (persistence threshold 0 and the
default), an evaluation that ends early every other time, ``empty_partition_cache()`` between forward and
backward -- against the same steps without prefetching; and a model that runs every module on every step."""

from zeroshim._prove import equal, failed_vs_equal, ranks_of

NAME = "zero3_inflight_params"
ARGS = ()
KEYS = ("losses", "evals", "param_sha256")
#: the other variants (``<variant>/without``, ``/with``, ``/reference``), each one of the three wrapped paths
OTHERS = ("default", "eval", "cache")


def judge(ranks):
    without, with_, proven = failed_vs_equal(ranks, "without", "with", "reference", keys=KEYS, patch=NAME)
    rest = all(failed_vs_equal(ranks, f"{v}/without", f"{v}/with", f"{v}/reference", keys=KEYS, patch=NAME)[2]
               for v in OTHERS)
    unchanged = all(equal(r["fixed/with"], r["fixed/without"], KEYS) for r in ranks)
    if proven and not rest:
        with_ = "the branch run matched, but the default-threshold, eval or empty_partition_cache variant did not"
    elif proven and not unchanged:
        with_ = "fixed the failures, but changed a run that has no leftover gathers (every module on every step)"
    elif proven:
        with_ = ("trained; losses, evaluations and parameters equal the same steps without prefetching bit for bit "
                 "(branch, default threshold, eval, empty_partition_cache); unchanged where nothing is left in flight")
    return without, with_, proven and rest and unchanged


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
