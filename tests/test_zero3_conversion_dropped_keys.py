"""Patch zero3_conversion_dropped_keys against real DeepSpeed and transformers (patches/zero3_conversion_dropped_keys/
scenario.py), 2 ranks: a tiny Mixtral saved with the legacy per-expert keys, loaded under ZeRO-3."""

import pytest

from harness import load_proof, torchrun
from zeroshim import _versions

pytestmark = pytest.mark.deepspeed
NAME = "zero3_conversion_dropped_keys"
# Only transformers 5.0.0 drops the keys that need no conversion (read from the released wheels 5.0.0 to 5.5.0 and
# measured on 5.0.0 to 5.5.0 and 5.23.0); the matrix has 4.49, 4.57 and 5.23, where the patch must be harmless.
TRANSFORMERS = _versions.installed("transformers")
AFFECTED = TRANSFORMERS is not None and _versions.base_version(TRANSFORMERS) == _versions.base_version("5.0.0")
# The patch's whole range: 5.0.0 (above) and 5.4.0 to 5.5.4, where the unscoped ``^model.language_model -> model``
# renaming of the Qwen3.5 / Gemma3n text models drops a vision-language model's own language-model keys (measured
# on 5.4.0, 5.5.0, 5.5.2, 5.5.4; 5.2.0, 5.3.0, 5.6.0 and 5.23.0 load them).
APPLIES, _ = _versions.check_affected({"transformers": ">=5.0.0,<5.6.0,!=5.1.*,!=5.2.*,!=5.3.*"})
VLM_AFFECTED = APPLIES and not AFFECTED


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("convkeys"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("zero3_conversion_dropped_keys").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)  # nothing to prove: the ZeRO-3 load is already right
        pytest.skip(f"transformers {TRANSFORMERS} does not drop the plain keys in its ZeRO-3 load (only 5.0.0 does; "
                    "4.x has no weight conversion)")
    assert proven, (without, with_)


def test_zero3_load_equals_plain_load(ranks):
    for rank in ranks:
        ref, off, on = rank["reference"], rank["without"], rank["with"]
        assert ref["ok"] and on["ok"], (ref, on)
        assert on["params"] == ref["params"] and on["loss"] == ref["loss"]  # bit for bit
        # every parameter partitioned: 21 on 5.x (fused experts), 41 on 4.x (one Linear per expert)
        assert on["partitioned"] == len(on["params"]) == (41 if TRANSFORMERS.startswith("4.") else 21)
        if not AFFECTED:
            assert off == on  # harmless where the bug is absent


def test_own_format_checkpoint(ranks):
    proof = load_proof("zero3_conversion_dropped_keys")
    for rank in ranks:
        ref, off, on = rank["own_reference"], rank["own_without"], rank["own_with"]
        assert on["params"] == ref["params"] and on["loss"] == ref["loss"]  # bit for bit
        # 5.0.0: every parameter of a checkpoint in its own (fused) format is dropped without zeroshim
        assert len(proof.differing(off, ref)) == (len(ref["params"]) if AFFECTED else 0)


def test_status_and_stats(ranks):
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if APPLIES else "skipped"), rank["status"]
        calls = 2 if APPLIES else 0  # one conversion with a WeightConverter per ZeRO-3 load with zeroshim
        assert rank["stats"] == {"calls": calls, "restored": 17 + 21 if AFFECTED else 0, "kept": 0}


# -- the vision-language form: a tiny Qwen3.5 (patches/zero3_conversion_dropped_keys/qwen35.py) --------------------

@pytest.fixture(scope="module")
def vlm_ranks(tmp_path_factory):
    ranks = torchrun(f"{NAME}/qwen35.py", 2, tmp_path_factory.mktemp("convvlm"))["ranks"]
    if ranks[0].get("skipped"):
        pytest.skip(f"transformers {TRANSFORMERS}: {ranks[0]['skipped']}")
    return ranks


def test_vlm_language_model_keys(vlm_ranks):
    """5.4.0 to 5.5.4: the 27 language-model parameters (of 49) are re-initialised under ZeRO-3 without zeroshim
    (huggingface/transformers#45313); with zeroshim, and on releases without the bug, the ZeRO-3 load equals the
    load without ZeRO-3 bit for bit."""
    proof = load_proof(NAME)
    for rank in vlm_ranks:
        ref, off, on = rank["reference"], rank["without"], rank["with"]
        assert ref["ok"] and off["ok"] and on["ok"], (ref, off, on)
        assert on["params"] == ref["params"] and on["loss"] == ref["loss"]  # bit for bit
        assert on["partitioned"] == len(on["params"]) == 49
        lost = proof.differing(off, ref)
        if VLM_AFFECTED:
            assert len(lost) == 27 and all(name.startswith("model.language_model.") for name in lost), lost
        else:
            assert off == on  # harmless where the bug is absent
        assert rank["status"]["state"] == ("applied" if APPLIES else "skipped"), rank["status"]
        assert rank["stats"] == {"calls": 0, "restored": 0, "kept": 27 if VLM_AFFECTED else 0}
