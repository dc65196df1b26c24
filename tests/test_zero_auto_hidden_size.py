"""Patch zero_auto_hidden_size against real accelerate + DeepSpeed (patches/zero_auto_hidden_size/scenario.py), 2 ranks:
``accelerator.prepare`` with "auto" ZeRO-3 bucket sizes on a tiny LLaVA whose config has only ``text_config.hidden_size``."""

import pytest

import zeroshim
from harness import load_proof, matches, torchrun

pytestmark = pytest.mark.deepspeed
PATCH = zeroshim.get_patch("zero_auto_hidden_size")
BY_HAND = [16 * 16, int(0.9 * 16 * 16), 10 * 16]  # hidden 16: reduce, prefetch, persistence


def _affected() -> bool:
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("accelerate")) >= Version("0.26.0")


AFFECTED = _affected()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("zero_auto_hidden_size", 2, tmp_path_factory.mktemp("autohidden"))["ranks"]


def test_status_follows_the_range(ranks):
    assert ranks[0]["status"]["state"] == ("applied" if AFFECTED else "skipped"), ranks[0]["status"]


def test_without_zeroshim(ranks):
    for rank in ranks:
        without = rank["without"]
        if AFFECTED:
            assert not without["ok"] and matches(PATCH.signatures[0], without["error"]), without.get("error")
        assert rank["text/without"]["ok"], rank["text/without"].get("error")  # a top-level hidden_size is filled
        assert rank["text/without"]["zero"] == BY_HAND


def test_with_zeroshim_trains_as_the_numbers_by_hand(ranks):
    for rank in ranks:
        with_, reference = rank["with"], rank["reference"]
        assert with_["ok"] and reference["ok"], (with_.get("error"), reference.get("error"))
        assert with_["zero"] == reference["zero"] == BY_HAND  # what the engine runs with
        assert with_["losses"] == reference["losses"]  # bit for bit
        assert with_["param_sha256"] == reference["param_sha256"]


def test_fills_only_auto_entries_of_text_config_models(ranks):
    for rank in ranks:
        keys = ["zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.stage3_param_persistence_threshold"]
        # the LLaVA run with "auto" only: not the explicit numbers, not the text model (top-level hidden_size)
        assert rank["filled"] == [list(pair) for pair in zip(keys, BY_HAND)]
        assert rank["filled_by_with"] == 3
        for run, reference in (("explicit/with", "reference"), ("text/with", "text/without")):
            assert rank[run]["ok"], rank[run].get("error")
            assert rank[run]["losses"] == rank[reference]["losses"]
            assert rank[run]["param_sha256"] == rank[reference]["param_sha256"]
            assert rank[run]["zero"] == BY_HAND


def test_proof(ranks):
    """The judge `zeroshim prove` uses (patches/zero_auto_hidden_size/proof.py) on this launch: accelerate's
    "Can find neither `model.config.hidden_size`" without zeroshim, the numbers-by-hand run with it."""
    without, with_, proven = load_proof("zero_auto_hidden_size").judge(ranks)
    assert proven == AFFECTED, (without, with_)
