"""The judge of ``zero_manual_accumulation`` (used by ``zeroshim prove`` and tests/test_zero_manual_accumulation.py):
gradient_accumulation_steps 1, three ``engine.backward()`` calls before each ``engine.step()``, ZeRO-2 with and
without ``offload_optimizer``; the reference is the same loop at stage 0, which sums the backward calls on every
release (ZeRO-2 reduces in another order: equal to float32 rounding; the test adds the bit-for-bit comparison with
DeepSpeed's own ``set_gradient_accumulation_boundary`` loop where that loop is right)."""

from zeroshim._prove import first_line, ranks_of, shows_bug

NAME = "zero_manual_accumulation"
ARGS = ()
TOLERANCE = 1e-6  # float32 rounding of a different reduction order; the lost micro-batches move parameters ~5e-2


def max_diff(run: dict, reference: dict) -> float:
    return max(abs(a - b) for a, b in zip(run["param_values"], reference["param_values"]))


def trained_like_reference(ranks, key: str) -> bool:
    return all(r[key].get("ok") and r["reference"].get("ok") and max_diff(r[key], r["reference"]) < TOLERANCE
               for r in ranks)


def silently_wrong(ranks, key: str) -> bool:
    return all(r[key].get("ok") and max_diff(r[key], r["reference"]) > 100 * TOLERANCE for r in ranks)


def refused(ranks, key: str) -> bool:
    return all(not r[key].get("ok") and shows_bug(NAME, r[key].get("error")) for r in ranks)


def judge(ranks):
    """Without offload: on DeepSpeed >= 0.17.6 the earlier micro-batches lost (or the TypeError) and with zeroshim
    the stage-0 sum; where DeepSpeed sums by itself, the sum either way.  With offload (every release): part of the
    micro-batches lost without zeroshim, the error with it.  Proven needs the offload part and a right ZeRO-2 run."""
    plain_wrong = silently_wrong(ranks, "without") or refused(ranks, "without")
    plain_with = trained_like_reference(ranks, "with")
    plain_ok = plain_with and (plain_wrong or trained_like_reference(ranks, "without"))
    offload_wrong = silently_wrong(ranks, "z2off/without")
    offload = offload_wrong and refused(ranks, "z2off/with")
    if refused(ranks, "without"):
        lost = first_line(ranks[0]["without"].get("error"))
    elif plain_wrong:
        lost = (f"ZeRO-2 trained on the last micro-batch only (parameters off by up to "
                f"{max(max_diff(r['without'], r['reference']) for r in ranks):.2g})")
    else:
        lost = "ZeRO-2 summed the micro-batches itself"
    without = lost + ("; with offload_optimizer it trained on part of them (off by up to "
                      f"{max(max_diff(r['z2off/without'], r['reference']) for r in ranks):.2g})" if offload_wrong
                      else "; with offload_optimizer it matched the reference")
    with_ = ("ZeRO-2 " + ("equals the stage-0 sum" if plain_with else "differs from the stage-0 sum") +
             "; offload: " + ("stopped with the error and its remedy" if offload else "no error"))
    return without, with_, plain_ok and offload


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
