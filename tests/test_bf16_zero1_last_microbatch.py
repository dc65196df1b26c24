"""Patch bf16_zero1_last_microbatch against real DeepSpeed (patches/bf16_zero1_last_microbatch/scenario.py), 2 ranks:
bf16 ZeRO-1 with ``grad_accum_dtype: fp32`` (BF16_Optimizer), gradient accumulation 2 and 1."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sdists (0.18.3 to 0.18.9 all-reduce before backward_epilogue(); 0.18.2 copies in
# backward(), 0.19.0 first; 0.18.3 and 0.18.4 never build BF16_Optimizer, their BFLOAT16 and DDP_BFLOAT16 being the
# same string), not read from the patch's gate: tests/test_inert_gates.py compares the two
AFFECTED = not ds_before("0.18.5") and ds_before("0.19.0")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return torchrun("bf16_zero1_last_microbatch", 2, tmp_path_factory.mktemp("bf16z1"))


@pytest.fixture(scope="module")
def ranks(launched):
    return launched["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("bf16_zero1_last_microbatch").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed averages the boundary micro-batch without zeroshim: {without}")
    assert proven, (without, with_)


def test_every_run_trained_with_the_optimizer_it_names(ranks):
    for rank in ranks:
        for key in ("reference", "without", "with", "ga1/reference", "ga1/without", "ga1/with"):
            assert rank[key]["ok"], (key, rank[key].get("error"))
            assert rank[key]["optimizer"] == "BF16_Optimizer", (key, rank[key]["optimizer"])
        assert rank["other/without"]["optimizer"] != "BF16_Optimizer"


def test_the_reference_averages_over_the_ranks(ranks):
    """The reference ends with the same parameters on both ranks (ZeRO-1 gathers the partitions each rank
    stepped)."""
    assert ranks[0]["reference"]["param_sha256"] == ranks[1]["reference"]["param_sha256"]
    assert ranks[0]["ga1/reference"]["param_sha256"] == ranks[1]["ga1/reference"]["param_sha256"]


def test_without_zeroshim(ranks):
    for rank in ranks:
        for key, ref in (("without", "reference"), ("ga1/without", "ga1/reference")):
            same = rank[key]["param_sha256"] == rank[ref]["param_sha256"]
            assert same != AFFECTED, (key, AFFECTED)


def test_with_zeroshim_equals_the_reference_bit_for_bit(ranks):
    for rank in ranks:
        for key, ref in (("with", "reference"), ("ga1/with", "ga1/reference")):
            assert (rank[key]["losses"], rank[key]["param_sha256"]) == \
                (rank[ref]["losses"], rank[ref]["param_sha256"]), key
        if AFFECTED:
            assert rank["stats"]["reordered"] == 6 + 3  # every backward of the two BF16_Optimizer runs
        else:
            assert rank["stats"] == {"reordered": 0}


def test_other_optimizers_are_left_alone(ranks):
    for rank in ranks:
        a, b = rank["other/without"], rank["other/with"]
        assert (a["losses"], a["param_sha256"]) == (b["losses"], b["param_sha256"])


def test_status_follows_the_range(ranks):
    state = ranks[0]["status"]
    assert state["state"] == ("applied" if AFFECTED else "skipped"), state


def test_the_change_is_said_once_per_job_where_it_changes_numbers(launched):
    """Once for the job (both ranks act), never for the reference runs (zeroshim not enabled yet) nor where the
    patch is not affected."""
    said = launched["log"].count("zeroshim[bf16_zero1_last_microbatch]: copied the boundary micro-batch")
    assert said == (1 if AFFECTED else 0), launched["log"][-3000:]
