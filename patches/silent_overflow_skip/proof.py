"""The judge of ``silent_overflow_skip`` (used by ``zeroshim prove`` and tests/test_silent_overflow_skip.py): ZeRO-1
and ZeRO-2 in bf16 with the overflow check on, one step of three with inf gradients, 2 ranks."""

from zeroshim._prove import equal, ranks_of

NAME = "silent_overflow_skip"
ARGS = ()
KEYS = ("losses", "param_sha256", "skipped_steps")
SAID = "zeroshim[silent_overflow_skip]: DeepSpeed skipped this optimizer step"
DEEPSPEED_SAYS = "OVERFLOW! Skipping step"


def judge(ranks, log: str = ""):
    """Proven: without zeroshim DeepSpeed skipped the inf step and reported the previous step's gradient norm for
    it, and (in the launch log, where given) said nothing; with zeroshim the same step was skipped, the run trained
    to the same parameters, the skipped step's norm is inf and zeroshim said so; runs without overflow are the same
    with and without zeroshim."""
    stages = ("1", "2")
    runs = [f"{s}/{k}" for s in stages for k in ("without", "with", "clean/without", "clean/with")]
    if len(ranks) < 2 or not all(r and r.get(k, {}).get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    silent = all(r[f"{s}/without"]["skipped_steps"] == [0, 1, 1]
                 and r[f"{s}/without"]["grad_norms"][1] == r[f"{s}/without"]["grad_norms"][0]
                 for r in ranks for s in stages) and (not log or DEEPSPEED_SAYS not in log)
    said = all(equal(r[f"{s}/with"], r[f"{s}/without"], KEYS) and r[f"{s}/with"]["grad_norms"][1] == float("inf")
               for r in ranks for s in stages) and (not log or SAID in log)
    harmless = all(equal(r[f"{s}/clean/with"], r[f"{s}/clean/without"], KEYS + ("grad_norms",))
                   for r in ranks for s in stages)
    without = ("the inf step was skipped in silence, its gradient norm reported as the previous step's" if silent
               else "the skip was not silent (or no step was skipped)")
    with_ = ("the same step skipped, the same parameters, its norm inf, and said" if said
             else "not said, or the run changed") + ("" if harmless else "; a run without overflow changed")
    return without, with_, silent and said and harmless


def prove(launch, out, nproc, device):
    result = launch(NAME, nproc, out, *ARGS)
    return judge(ranks_of(result), result.get("log", ""))
