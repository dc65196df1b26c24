"""Patch zero3_unwrapped_model against real transformers and DeepSpeed (patches/zero3_unwrapped_model/scenario.py),
2 ranks: a tiny Llama built under a ZeRO-3 HfDeepSpeedConfig, called without a DeepSpeed engine."""

import pytest

from harness import load_proof, torchrun

pytestmark = pytest.mark.deepspeed
AFFECTED = True  # every release: not a bug of either library, a message that names neither cause nor remedy


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("zero3_unwrapped_model", 2, tmp_path_factory.mktemp("unwrapped"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("zero3_unwrapped_model").judge(ranks)
    assert proven, (without, with_)


@pytest.mark.parametrize("threshold", ["", "default/"], ids=["threshold_0", "default_threshold"])
def test_without_zeroshim_the_error_names_nothing(ranks, threshold):
    for rank in ranks:
        run = rank[f"{threshold}without"]
        assert not run["ok"] and "'weight' must be 2-D" in run["error"]


@pytest.mark.parametrize("threshold", ["", "default/"], ids=["threshold_0", "default_threshold"])
def test_with_zeroshim_the_error_names_the_cause_and_the_remedies(ranks, threshold):
    for rank in ranks:
        error = rank[f"{threshold}with"]["error"]
        assert error.startswith("UnwrappedZero3Model: zeroshim[zero3_unwrapped_model]: LlamaForCausalLM was built")
        for remedy in ("deepspeed.initialize", "GatheredParameters", "ZEROSHIM_ZERO3_UNWRAPPED_MODEL=off"):
            assert remedy in error, (remedy, error)
        # the two failing calls; a model and its inner LlamaModel hooked per build (4 builds)
        assert rank["stats"] == {"acted": 2, "hooked": 8}, rank["stats"]


@pytest.mark.parametrize("pair", ["engine", "gathered"])
def test_calls_that_work_are_unchanged_bit_for_bit(ranks, pair):
    for rank in ranks:
        a, b = rank[f"{pair}/without"], rank[f"{pair}/with"]
        assert a["ok"] and b["ok"], (a.get("error"), b.get("error"))
        assert a["logits_sha256"] == b["logits_sha256"]


def test_status(ranks):
    assert ranks[0]["status"]["state"] == "applied", ranks[0]["status"]
