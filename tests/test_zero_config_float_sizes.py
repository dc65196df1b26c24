"""Patch zero_config_float_sizes against real DeepSpeed (patches/zero_config_float_sizes/scenario.py), 2 ranks:
``zero_optimization`` sizes computed as floats (``0.9 * hidden * hidden``), ZeRO-3 and ZeRO-2."""

import pytest

import zeroshim
from harness import ds_before, load_proof, matches, torchrun

pytestmark = pytest.mark.deepspeed
PATCH = zeroshim.get_patch("zero_config_float_sizes")
AFFECTED = not ds_before("0.15.0")  # pydantic v2 config models
ROUNDED = {"zero_optimization.reduce_bucket_size": [633.6, 634],
           "zero_optimization.stage3_prefetch_bucket_size": [0.9 * 24 * 24, 518],
           "zero_optimization.allgather_bucket_size": [0.9 * 24 * 24, 518]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("zero_config_float_sizes", 2, tmp_path_factory.mktemp("floatsizes"))["ranks"]


def test_status_follows_the_range(ranks):
    assert ranks[0]["status"]["state"] == ("applied" if AFFECTED else "skipped"), ranks[0]["status"]


@pytest.mark.parametrize("run", ["", "z2/"], ids=["zero3", "zero2"])
def test_without_zeroshim(ranks, run):
    for rank in ranks:
        without = rank[f"{run}without"]
        if AFFECTED:
            assert not without["ok"] and matches(PATCH.signatures[0][0], without["error"]), without.get("error")
            assert matches(PATCH.signatures[0][1], without["error"])
        else:  # pydantic v1 truncated the floats silently (633.6 -> 633)
            assert without["ok"], without.get("error")
            assert without["zero_config"]["reduce_bucket_size"] == 633


@pytest.mark.parametrize("run", ["", "z2/"], ids=["zero3", "zero2"])
def test_with_zeroshim_trains_as_the_rounded_config(ranks, run):
    for rank in ranks:
        with_, reference = rank[f"{run}with"], rank[f"{run}reference"]
        assert with_["ok"] and reference["ok"], (with_.get("error"), reference.get("error"))
        assert with_["user_dict_kept"]  # the caller's config dict is not changed
        if AFFECTED:
            assert with_["zero_config"] == reference["zero_config"]
            assert with_["losses"] == reference["losses"]  # bit for bit
            assert with_["param_sha256"] == reference["param_sha256"]


def test_rounds_only_fractional_floats_of_int_fields(ranks):
    for rank in ranks:
        rounded = rank["rounded"]
        if not AFFECTED:
            assert rounded == []
            continue
        assert {key for key, _, _ in rounded} == set(ROUNDED)  # 1e9 (integral, valid already) is not among them
        for key, value, new in rounded:
            assert [value, new] == ROUNDED[key]
        edges = rank["edges"]
        assert edges["integral"] == {"ok": True, "reduce_bucket_size": 500000000}
        assert not edges["negative"]["ok"] and "input_value=-2.5" in edges["negative"]["error"]  # DeepSpeed's error
        assert not edges["inf"]["ok"]
        assert rank["rounded_after_edges"] == len(rounded)


def test_doctor_flags_fractional_sizes():
    from zeroshim import _cli

    config = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0.9 * 4096 * 4096,
                                    "reduce_bucket_size": 4096 * 4096, "stage3_max_live_parameters": 1e9}}
    findings = [f for f in _cli.check_config(config) if f["patch"] == "zero_config_float_sizes"]
    assert len(findings) == (1 if AFFECTED else 0), findings
    if AFFECTED:
        assert findings[0]["level"] == "error"
        assert "stage3_prefetch_bucket_size=15099494.4" in findings[0]["message"] and "15099494" in findings[0]["message"]
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 15099494
    assert not [f for f in _cli.check_config(config) if f["patch"] == "zero_config_float_sizes"]


def test_proof(ranks):
    """The judge `zeroshim prove` uses (patches/zero_config_float_sizes/proof.py) on this launch: pydantic's
    int_from_float without zeroshim, the rounded config's run with it; where not affected, nothing to prove."""
    without, with_, proven = load_proof("zero_config_float_sizes").judge(ranks)
    assert proven == AFFECTED, (without, with_)
