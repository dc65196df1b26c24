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
        for key in ("reference", "without", "with", "ga1/without", "ga1/with", "mlp/reference", "mlp/without",
                    "mlp/with"):
            assert rank[key]["ok"], (key, rank[key].get("error"))


def test_without_zeroshim_the_last_micro_batch_only(ranks):
    """The gradient norm ZeRO-2 reports is that of the last of 4 micro-batches, divided by 4: well below the
    reference's, which sums all four."""
    for rank in ranks:
        without, reference = rank["without"]["grad_norms"], rank["reference"]["grad_norms"]
        if AFFECTED:
            assert all(w < 0.5 * r for w, r in zip(without, reference)), (without, reference)
        else:
            assert without == reference


def test_with_zeroshim_equals_zero1_bit_for_bit(ranks):
    for rank in ranks:
        assert (rank["with"]["losses"], rank["with"]["grad_norms"], rank["with"]["param_sha256"]) == \
            (rank["reference"]["losses"], rank["reference"]["grad_norms"], rank["reference"]["param_sha256"])
        # 2 steps of 4 micro-batches: the 2nd, 3rd and 4th of each add to the earlier ones, in the exact run and the
        # MLP run
        assert rank["stats"] == {"accumulated": 12 if AFFECTED else 0}


def test_the_mlp_reports_zero1s_gradient_norms(ranks):
    """On a model whose sums are not exact ZeRO-1 and ZeRO-2 reduce in another order, so only close; without
    zeroshim ZeRO-2 reports about a quarter."""
    for rank in ranks:
        with_, reference = rank["mlp/with"]["grad_norms"], rank["mlp/reference"]["grad_norms"]
        assert with_ == pytest.approx(reference, rel=1e-5)
        if not AFFECTED:
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
