"""Patch zero_cpu_unreduced_grads against real DeepSpeed (patches/zero_cpu_unreduced_grads/scenario.py), 2 ranks:
ZeRO-1/2 with ``contiguous_gradients: false`` on the CPU accelerator, against the same runs with contiguous
gradients."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sdists (runtime/zero/stage_1_and_2.py, split_half_float_double: type names built from
# the accelerator's device name before 0.19.8, dtypes from 0.19.8), not read from the patch's gate:
# tests/test_inert_gates.py compares the two
AFFECTED = ds_before("0.19.8")
CASES = load_proof("zero_cpu_unreduced_grads").CASES


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return torchrun("zero_cpu_unreduced_grads", 2, tmp_path_factory.mktemp("cpugrads"))


@pytest.fixture(scope="module")
def ranks(launched):
    return launched["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("zero_cpu_unreduced_grads").judge(ranks)
    assert proven == AFFECTED, (without, with_)


def test_every_run_trained_with_zero_s_optimizer(ranks):
    for rank in ranks:
        for case in CASES:
            for kind in ("reference", "without", "with", "clean/with"):
                run = rank[f"{case}/{kind}"]
                assert run["ok"], (case, kind, run.get("error"))
                assert run["optimizer"] == "DeepSpeedZeroOptimizer", (case, kind)


def test_the_reference_steps_with_the_average_over_the_ranks(ranks):
    """The fp32 references without accumulation end bit for bit where one process ends that steps with the gradient
    averaged over both ranks' data (param_digest reads the parameters as the digest there does)."""
    for rank in ranks:
        assert rank["one_process"]["ok"], rank["one_process"].get("error")
        for case in ("1/fp32", "2/fp32"):
            assert rank[f"{case}/reference"]["param_sha256"] == rank["one_process"]["param_sha256"], case


def test_without_zeroshim(ranks):
    for rank in ranks:
        for case in CASES:
            same = rank[f"{case}/without"]["param_sha256"] == rank[f"{case}/reference"]["param_sha256"]
            assert same != AFFECTED, case


def test_with_zeroshim_equals_the_reference_bit_for_bit(ranks):
    for rank in ranks:
        for case in CASES:
            for kind in ("with", "clean/with"):
                run, ref = rank[f"{case}/{kind}"], rank[f"{case}/reference"]
                assert (run["losses"], run["param_sha256"]) == (ref["losses"], ref["param_sha256"]), (case, kind)


def test_counted_and_said_once(launched, ranks):
    for rank in ranks:
        assert rank["status"]["state"] == ("applied" if AFFECTED else "skipped"), rank["status"]
        # one reduction per optimizer step (3 per case), per micro-batch under ZeRO-2 with accumulation (6); 4
        # parameters each
        assert rank["stats"] == ({"recovered": 15, "tensors": 60} if AFFECTED else {"recovered": 0, "tensors": 0})
    said = launched["log"].count("zeroshim[zero_cpu_unreduced_grads]: all-reduced")
    assert said == (1 if AFFECTED else 0), launched["log"][-3000:]
