"""Patch zero2_accumulation_overwrite against real DeepSpeed (patches/zero2_accumulation_overwrite/scenario.py), 2
ranks: ZeRO-2 with 4 micro-batches a step against ZeRO-1, on data where every sum is exact."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sources (0.17.6 tests averaged_gradients before replacing all_grad_tensors, 0.18.3
# tests all_grad_tensors), not read from the patch's gate: tests/test_inert_gates.py compares the two
AFFECTED = not ds_before("0.17.6") and ds_before("0.18.3")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return torchrun("zero2_accumulation_overwrite", 2, tmp_path_factory.mktemp("z2acc"))


@pytest.fixture(scope="module")
def ranks(launched):
    return launched["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("zero2_accumulation_overwrite").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed sums the micro-batches under ZeRO-2: {without}")
    assert proven, (without, with_)


def test_every_run_trained(ranks):
    for rank in ranks:
        for key in ("reference", "without", "with", "last_only", "ga1/without", "ga1/with", "marked/reference",
                    "marked/without", "marked/with", "mlp/reference", "mlp/without", "mlp/with"):
            assert rank[key]["ok"], (key, rank[key].get("error"))


def test_without_zeroshim_the_last_micro_batch_only(ranks):
    """Without zeroshim ZeRO-2 ends with the parameters of a run in which only the last micro-batch of each step has
    a loss, bit for bit (exact data); with zeroshim, and on other releases, with those of all four."""
    for rank in ranks:
        without = rank["without"]["param_sha256"]
        assert without == rank["last_only" if AFFECTED else "reference"]["param_sha256"]
        assert rank["last_only"]["param_sha256"] != rank["reference"]["param_sha256"]


def test_with_zeroshim_equals_zero1_bit_for_bit(ranks):
    for rank in ranks:
        for key, ref in (("with", "reference"), ("marked/with", "marked/reference")):
            assert (rank[key]["losses"], rank[key]["grad_norms"], rank[key]["param_sha256"]) == \
                (rank[ref]["losses"], rank[ref]["grad_norms"], rank[ref]["param_sha256"]), key
        # 2 steps of 4 micro-batches in three runs (exact, marked, MLP), one parameter group each: the 2nd, 3rd and
        # 4th micro-batch of each step add to the earlier ones
        assert rank["stats"] == {"accumulated": 18 if AFFECTED else 0}


def test_marked_accumulation(ranks):
    """``set_gradient_accumulation_boundary(False)`` before the earlier backward calls of a step, with
    ``gradient_accumulation_steps`` 1: the same overwrite without zeroshim."""
    for rank in ranks:
        same = rank["marked/without"]["param_sha256"] == rank["marked/reference"]["param_sha256"]
        assert same != AFFECTED


def test_the_mlp_reports_zero1s_gradient_norms(ranks):
    """On a model whose sums are not exact ZeRO-1 and ZeRO-2 reduce in another order, so only close; without
    zeroshim ZeRO-2 reports well below them (one micro-batch of four)."""
    for rank in ranks:
        with_, reference = rank["mlp/with"]["grad_norms"], rank["mlp/reference"]["grad_norms"]
        assert with_ == pytest.approx(reference, rel=1e-5)
        without = rank["mlp/without"]["grad_norms"]
        if AFFECTED:
            assert all(w < 0.75 * r for w, r in zip(without, reference)), (without, reference)
        else:
            assert rank["mlp/without"]["param_sha256"] == rank["mlp/with"]["param_sha256"]


def test_no_accumulation_is_left_alone(ranks):
    for rank in ranks:
        a, b = rank["ga1/without"], rank["ga1/with"]
        assert (a["losses"], a["param_sha256"]) == (b["losses"], b["param_sha256"])


def test_status_follows_the_range(ranks):
    state = ranks[0]["status"]
    assert state["state"] == ("applied" if AFFECTED else "skipped"), state


def test_the_change_is_said_once_per_job(launched):
    said = launched["log"].count("zeroshim[zero2_accumulation_overwrite]: added each micro-batch")
    assert said == (1 if AFFECTED else 0), launched["log"][-3000:]
