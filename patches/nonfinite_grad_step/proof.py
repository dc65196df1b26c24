"""The judge of ``nonfinite_grad_step`` (used by ``zeroshim prove`` and tests/test_nonfinite_grad_step.py): ZeRO-3 in
bf16 and fp32, ZeRO-1 and ZeRO-2 (CPU offload) in fp32, one step of three with a NaN in rank 0's input, 2 ranks; and
bf16 ZeRO-2 without the overflow check, where DeepSpeed 0.19.8 applies the step too."""

import math

from zeroshim._prove import equal, ranks_of

NAME = "nonfinite_grad_step"
ARGS = ()
SKIPPING = ("3/bf16", "3/fp32", "3/fp32/offload", "1/fp32", "2/fp32/offload")
APPLYING = "2/bf16"
KEYS = ("param_sha256",)
#: said once per skipped step, on global rank 0: one per case in SKIPPING, and the unpatched run's
SAID = "zeroshim[nonfinite_grad_step]: skipped this optimizer step"
SAID_WRITTEN = "zeroshim[nonfinite_grad_step]: this optimizer step was applied with gradients that hold inf or NaN"


#: the norm DeepSpeed < 0.19.8 reports for the NaN step: both groups' -1, squared and summed
LAUNDERED = math.sqrt(2)
#: DeepSpeed <= 0.17.0's ZeRO-1/2 CPU-offload norm returns its -1 as an int: the L2 norm of the groups fails on it
INT_NORM = "Expected a floating point or complex tensor"


def _finite(run) -> bool:
    return all(math.isfinite(v) for v in run["param_sums"].values())


def applied(run) -> bool:
    """The NaN step was applied without a word: nothing skipped, the weights no longer finite, the norm reported
    as sqrt(2) (the -1 each invalid group norm is masked to, squared: 1.0 with one group) or nan (releases whose mask lets NaN through, such
    as 0.14.1's ZeRO-3); or, CPU offload on DeepSpeed <= 0.17.0, it stopped on the integer -1."""
    if not run.get("ok"):
        return INT_NORM in (run.get("error") or "")
    norm = run["grad_norms"][1]
    return run["skipped_steps"] == [0, 0, 0] and not _finite(run) and norm is not None \
        and (math.isclose(norm, LAUNDERED, rel_tol=1e-6) or math.isnan(norm))


def judge(ranks, log: str = ""):
    """Proven: without zeroshim each case applied the NaN step in silence (:func:`applied`); with zeroshim the step was skipped (counted,
    its norm inf, said) and the run ended bit for bit where the run of the first and third steps ends, and a
    checkpoint's optimizer state right after the skip stores no overflow; where 0.19.8 applies the step too (bf16
    ZeRO-2 without the check), the run is the same with and without zeroshim, its norm reported inf and said; three
    finite steps are the same with and without zeroshim in every case."""
    cases = SKIPPING + (APPLYING,)
    runs = [f"{c}/{k}" for c in cases for k in ("with", "reference", "clean/without", "clean/with")]
    if len(ranks) < 2 or not all(r and r.get(k, {}).get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    silent = all(applied(r[f"{c}/without"]) for r in ranks for c in cases) and (not log or "Skipping step" not in log)
    skipped = all(equal(r[f"{c}/with"], r[f"{c}/reference"], KEYS) and _finite(r[f"{c}/with"])
                  and r[f"{c}/with"]["skipped_steps"] == [0, 1, 1] and r[f"{c}/with"]["grad_norms"][1] == math.inf
                  and r[f"{c}/with"]["losses"][2] == r[f"{c}/reference"]["losses"][1]
                  and r[f"{c}/with"]["stored_overflow"] in (False, None)
                  for r in ranks for c in SKIPPING) and (not log or log.count(SAID) == len(SKIPPING) + 1)
    unchecked = all(equal(r[f"{APPLYING}/with"], r[f"{APPLYING}/without"], KEYS + ("losses", "skipped_steps"))
                  and r[f"{APPLYING}/with"]["grad_norms"][1] == math.inf
                  for r in ranks) and (not log or SAID_WRITTEN in log)
    harmless = all(equal(r[f"{c}/clean/with"], r[f"{c}/clean/without"], KEYS + ("losses", "grad_norms"))
                   for r in ranks for c in cases)
    without = ("each NaN step was applied in silence: the weights not finite, no step skipped, the norm reported "
               "1.0 or nan (or, CPU offload on <= 0.17.0, a crash)" if silent else "a NaN step was skipped (or not silent, or the weights stayed finite)")
    with_ = ("skipped (counted, norm inf, said), ending bit for bit as the two-step run; bf16 ZeRO-2 unchecked "
             "applied as without, its norm inf and said" if skipped and unchecked
             else "not skipped as 0.19.8 skips, or the unchecked bf16 run changed")
    with_ += "" if harmless else "; a finite run changed"
    return without, with_, silent and skipped and unchecked and harmless


def prove(launch, out, nproc, device):
    result = launch(NAME, nproc, out, *ARGS)
    return judge(ranks_of(result), result.get("log", ""))
