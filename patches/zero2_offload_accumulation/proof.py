"""The judge of ``zero2_offload_accumulation`` (used by ``zeroshim prove`` and
tests/test_zero2_offload_accumulation.py): ZeRO-2 + offload_optimizer + gradient accumulation 4."""

from zeroshim._prove import equal, ranks_of

NAME = "zero2_offload_accumulation"
ARGS = ()


def judge(ranks):
    diffs = [max(abs(a - b) for a, b in zip(r["without/ga4/clip0"]["param_values"],
                                            r["reference/ga4/clip0"]["param_values"])) for r in ranks]
    silent = all(r["without/ga4/clip0"]["ok"] for r in ranks) and min(diffs) > 1e-4
    same = all(equal(r["with/ga4/clip0"], r["reference/ga4/clip0"]) for r in ranks)
    return (f"trained on other gradients (GA 4: parameters differ from the run without offload by up to "
            f"{max(diffs):.2g})" if silent else "matched the run without offload (the bug did not show)",
            "equals the run without offload bit for bit" if same else "differs from the run without offload",
            silent and same)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
