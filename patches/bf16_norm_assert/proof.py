"""The judge of ``bf16_norm_assert`` (used by ``zeroshim prove`` and tests/test_bf16_norm_assert.py): bf16 ZeRO-1
with fp32 gradient accumulation (``BF16_Optimizer``), a step with all-zero gradients and one with inf gradients,
2 ranks."""

from zeroshim._prove import equal, ranks_of, shows_bug

NAME = "bf16_norm_assert"
ARGS = ()
KEYS = ("ends", "param_sha256")


def judge(ranks):
    """Proven: on ``BF16_Optimizer``, without zeroshim both the zero-gradient step and the non-finite one stop with
    this bug's AssertionError on every rank; with zeroshim the zero step is taken (SGD: the weights stay) and the
    non-finite one skipped (counted in ``skipped_steps``, its norm inf), both ending bit for bit where the run of
    the other two steps ends; three finite steps are the same with and without zeroshim."""
    if len(ranks) < 2 or not all(r for r in ranks):
        return "a rank wrote nothing", "a rank wrote nothing", False
    if not all(r["clean/without"].get("optimizer") == "BF16_Optimizer" for r in ranks):
        return "DeepSpeed does not build BF16_Optimizer for this config", "not reached", False
    stopped = all(not r[k].get("ok") and shows_bug(NAME, r[k]["error"]) for r in ranks
                  for k in ("zero/without", "inf/without"))
    fixed = all(equal(r[k], r["reference"], KEYS) for r in ranks for k in ("zero/with", "inf/with")) and \
        all(r["inf/with"]["skipped_steps"] == [0, 1, 1] and r["inf/with"]["grad_norms"][1] == float("inf")
            and r["zero/with"]["skipped_steps"] == [0, 0, 0] and r["zero/with"]["grad_norms"][1] == 0.0
            for r in ranks)
    harmless = all(equal(r["clean/with"], r["clean/without"], KEYS + ("grad_norms",)) for r in ranks)
    without = ("both steps stopped with the bare AssertionError" if stopped
               else "a step went through (or stopped otherwise)")
    with_ = ("the zero step taken and the non-finite one skipped, both ending as the two-step run, bit for bit"
             if fixed else "a run failed or differed from the two-step run") + (
        "" if harmless else "; a finite run changed")
    return without, with_, stopped and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
