"""The judge of ``checkpoint_weights_only`` (used by ``zeroshim prove`` and tests/test_checkpoint_weights_only.py):
resume a ZeRO-3 checkpoint on torch >= 2.6; a checkpoint carrying a foreign global is still refused."""

from zeroshim._prove import first_line, ranks_of

NAME = "checkpoint_weights_only"
ARGS = ()


def judge(ranks):
    without, with_ = [r["resume/without/z3"] for r in ranks], [r["resume/with/z3"] for r in ranks]
    failed = all(not w["ok"] for w in without)
    resumed = all(w["ok"] and w["losses"] == r["straight/z3"]["losses"] for w, r in zip(with_, ranks))
    refused = all(not r["foreign/with/z3"]["ok"] and not r["foreign/with/z3"]["marker_exists"] for r in ranks)
    return (first_line(without[0].get("error")) if failed else "resumed (the bug did not show)",
            ("resumed; losses equal the uninterrupted run; a foreign global is still refused" if resumed and refused
             else "did not resume exactly, or a foreign global was loaded"), failed and resumed and refused)


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, max(nproc, 1), out, *ARGS)))
