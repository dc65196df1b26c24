"""The judge of ``zero3_from_config_init`` (used by ``zeroshim prove`` and tests/test_zero3_from_config_init.py):
``from_config`` of a tiny Llama under a ZeRO-3 ``HfDeepSpeedConfig``, 2 ranks."""

from zeroshim._prove import ranks_of

NAME = "zero3_from_config_init"
ARGS = ()


#: how far a parameter's standard deviation may be from the reference's (a 32 x 32 draw of N(0, 0.02) has a
#: relative spread of about 2.5 %; torch's defaults are 5 (Kaiming-uniform) to 50 (embedding) times larger)
TOLERANCE = 0.2


def follows(run: dict, reference: dict) -> bool:
    """Is every parameter initialised as the reference's: a constant one (norms) equal bit for bit, a random one
    with a standard deviation within TOLERANCE of the reference's?"""
    for name, sha in reference["sha"].items():
        ref_std, std = reference["std"][name], run["std"].get(name)
        if ref_std == 0.0:
            if run["sha"].get(name) != sha:
                return False
        elif std is None or abs(std - ref_std) > TOLERANCE * ref_std:
            return False
    return set(run["sha"]) == set(reference["sha"])


def judge(ranks):
    """Proven: on every rank, without zeroshim the ZeRO-3 model is not initialised as the model built without
    DeepSpeed (torch's default initialisation), and with a padding row it fails or is not either; with zeroshim
    every parameter is (constant ones bit for bit, random ones at the reference's scale, the padding row zero) and
    every rank holds the same model; and without a DeepSpeed config zeroshim changed nothing, bit for bit."""
    runs = ("reference", "without", "with", "plain/with", "pad/reference", "pad/with")
    if not ranks or not all(r[k].get("ok") for r in ranks for k in runs):
        return "a run failed", "a run failed", False
    r0 = ranks[0]
    wrong = all(r["without"]["partitioned"] and not follows(r["without"], r["reference"])
                and not (r["pad/without"].get("ok") and follows(r["pad/without"], r["pad/reference"])) for r in ranks)
    fixed = all(r["with"]["partitioned"] and follows(r["with"], r["reference"]) and r["pad/with"]["partitioned"]
                and follows(r["pad/with"], r["pad/reference"]) and r["pad/with"]["pad_row_zero"] for r in ranks) \
        and len({str(sorted(r["with"]["sha"].items())) for r in ranks}) == 1
    harmless = all(r["plain/with"]["sha"] == r["reference"]["sha"] for r in ranks)
    pad = r0["pad/without"]
    without = (f"torch's default initialisation (embedding std {r0['without']['embed_std']:.3f}, q_proj "
               f"{r0['without']['q_std']:.3f}; the model's own: {r0['reference']['embed_std']:.3f}, "
               f"{r0['reference']['q_std']:.3f}); with a padding row: "
               + (pad["error"] if not pad.get("ok") else "the same") if wrong
               else "initialised as without DeepSpeed: the bug did not show")
    with_ = ("initialised as the model built without DeepSpeed (embedding std "
             f"{r0['with']['embed_std']:.3f}, q_proj {r0['with']['q_std']:.3f}; with a padding row too, that row "
             "zero), the same on every rank" if fixed else
             "not initialised as the model built without DeepSpeed") + ("" if harmless else "; a plain build changed")
    return without, with_, wrong and fixed and harmless


def prove(launch, out, nproc, device):
    return judge(ranks_of(launch(NAME, nproc, out, *ARGS)))
