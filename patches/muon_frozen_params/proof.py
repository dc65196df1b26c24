"""The judge of ``muon_frozen_params`` (used by ``zeroshim prove`` and tests/test_muon_frozen_params.py): DeepSpeed's
Muon optimizer from the config on a partly frozen model, ``model_parameters=model.parameters()``."""

from zeroshim._prove import equal, ranks_of

NAME = "muon_frozen_params"
ARGS = ()
KEYS = ("losses", "param_sha256", "frozen_moved")
FAILS = "torch.cat(): expected a non-empty list of Tensors"


def judge(ranks):
    """Proven: on every rank, without zeroshim ZeRO-2 with only Muon matrices trainable fails with the torch.cat
    error and ZeRO-0 decays the frozen embedding and norm (it differs from the reference, which passes only the
    trainable parameters: the groups DeepSpeed 0.18.7 builds); with zeroshim both equal the reference bit for bit
    (losses, parameters, no frozen parameter moved); and where ZeRO-2 already leaves the frozen parameters out
    (both groups keep trainable members) the runs are equal bit for bit and the patch did not act."""
    runs = [f"{case}/{arm}" for case in ("zero2/adapters", "zero0/frozen_embed", "zero2/mixed")
            for arm in ("reference", "with")] + ["zero0/frozen_embed/without", "zero2/mixed/without"]
    if not ranks or not all(r[k].get("ok") for r in ranks for k in runs):
        failed = sorted({k for r in ranks for k in runs if not r[k].get("ok")})
        return f"a run failed: {failed}", f"a run failed: {failed}", False
    r0 = ranks[0]
    crashed = all(not r["zero2/adapters/without"]["ok"] and FAILS in r["zero2/adapters/without"]["error"]
                  for r in ranks)
    decayed = all(r["zero0/frozen_embed/without"]["frozen_moved"]
                  and not equal(r["zero0/frozen_embed/without"], r["zero0/frozen_embed/reference"], KEYS)
                  for r in ranks)
    fixed = all(equal(r[f"{case}/with"], r[f"{case}/reference"], KEYS) and not r[f"{case}/with"]["frozen_moved"]
                for r in ranks for case in ("zero2/adapters", "zero0/frozen_embed"))
    harmless = all(equal(r["zero2/mixed/with"], r["zero2/mixed/without"], KEYS)
                   and r["zero2/mixed/acted"] == r["zero0/frozen_embed/acted"] for r in ranks)
    without = "; ".join([
        "ZeRO-2 with only Muon matrices trainable failed: " + FAILS if crashed else
        "ZeRO-2 with only Muon matrices trainable: " + str(r0["zero2/adapters/without"].get("error", "trained")),
        f"ZeRO-0 moved the frozen {r0['zero0/frozen_embed/without']['frozen_moved']}" if decayed else
        "ZeRO-0 left the frozen parameters alone"])
    with_ = ("both train as the reference (only the trainable parameters passed), losses and parameters bit for "
             "bit, no frozen parameter moved" if fixed else "differs from the reference") + \
        ("" if harmless else "; ZeRO-2 with both groups trainable changed, or the patch acted there")
    return without, with_, crashed and decayed and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
