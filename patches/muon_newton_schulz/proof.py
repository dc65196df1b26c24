"""The judge of ``muon_newton_schulz`` (used by ``zeroshim prove`` and tests/test_muon_newton_schulz.py): DeepSpeed's
Muon optimizer from the config without ZeRO (fp32 and bf16), and under ZeRO-2."""

from zeroshim._prove import equal, ranks_of

NAME = "muon_newton_schulz"
ARGS = ()
ZERO0 = ("zero0/fp32", "zero0/bf16")


def judge(ranks):
    """Proven: on every rank, without ZeRO (fp32 and bf16) the run without zeroshim differs from the reference
    (DeepSpeed's own ``SingleDeviceMuon``, the Muon reference implementation, as a client optimizer) and the run
    with zeroshim equals it bit for bit (losses, parameters); under ZeRO-2 the runs with and without zeroshim are
    equal bit for bit and the patch did not act."""
    runs = [f"{c}/{arm}" for c in ZERO0 for arm in ("reference", "without", "with")] + \
        ["zero2/fp32/without", "zero2/fp32/with"]
    if not ranks or not all(r[k].get("ok") for r in ranks for k in runs):
        failed = sorted({k for r in ranks for k in runs if not r[k].get("ok")})
        return f"a run failed: {failed}", f"a run failed: {failed}", False
    sgd = all(not equal(r[f"{c}/without"], r[f"{c}/reference"]) for r in ranks for c in ZERO0)
    fixed = all(equal(r[f"{c}/with"], r[f"{c}/reference"]) for r in ranks for c in ZERO0)
    harmless = all(equal(r["zero2/fp32/with"], r["zero2/fp32/without"])
                   and r["zero2/fp32/acted"] == r["zero0/bf16/acted"] for r in ranks)
    without = ("without ZeRO (fp32 and bf16) the matrices trained otherwise than Muon's reference: the raw "
               "gradient, SGD" if sgd else "without ZeRO the runs equal Muon's reference: the bug did not show")
    with_ = ("fp32 and bf16 equal Muon's reference bit for bit (losses, parameters)" if fixed else
             "differs from Muon's reference") + ("" if harmless else "; ZeRO-2 changed, or the patch acted there")
    return without, with_, sgd and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
