"""Patch muon_newton_schulz against real DeepSpeed (patches/muon_newton_schulz/scenario.py), 2 ranks: DeepSpeed's Muon
optimizer from the config without ZeRO (fp32, bf16) and under ZeRO-2, against DeepSpeed's own ``SingleDeviceMuon``."""

import subprocess
import sys

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sdists (0.17.5 has no Muon; 0.17.6, 0.18.2 and 0.19.6 step the Muon group with the raw
# gradient; 0.19.7 and 0.19.8 with muon_update's result), not read from the patch's gate: tests/test_inert_gates.py
# compares the two
AFFECTED = not ds_before("0.17.6") and ds_before("0.19.7")
HAS_MUON = not ds_before("0.17.6")
ZERO0 = ("zero0/fp32", "zero0/bf16")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not HAS_MUON:
        pytest.skip("this DeepSpeed has no Muon optimizer (from 0.17.6)")
    return torchrun("muon_newton_schulz", 2, tmp_path_factory.mktemp("muon_ns"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("muon_newton_schulz").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed computes Muon's update without ZeRO itself: {without}")
    assert proven, (without, with_)


def test_every_run_trained_through_the_expected_optimizer(ranks):
    wrappers = {"zero0/fp32/reference": "SingleDeviceMuon", "zero0/fp32/without": "MuonWithAuxAdam",
                "zero0/bf16/without": "FP16_UnfusedOptimizer", "zero2/fp32/without": "DeepSpeedZeroOptimizer"}
    for rank in ranks:
        for key, wrapper in wrappers.items():
            for arm in {key, key.replace("/without", "/with")}:
                assert rank[arm]["ok"], (arm, rank[arm].get("error"))
                assert rank[arm]["wrapper"] == wrapper, (arm, rank[arm]["wrapper"])


def test_without_zeroshim(ranks):
    for rank in ranks:
        for case in ZERO0:
            run, ref = rank[f"{case}/without"], rank[f"{case}/reference"]
            same = (run["losses"], run["param_sha256"]) == (ref["losses"], ref["param_sha256"])
            assert same is not AFFECTED, case  # silent: it trains, by SGD, where affected


def test_with_zeroshim_as_muons_reference_bit_for_bit(ranks):
    for rank in ranks:
        for case in ZERO0:
            run, ref = rank[f"{case}/with"], rank[f"{case}/reference"]
            assert (run["losses"], run["param_sha256"]) == (ref["losses"], ref["param_sha256"]), case


def test_zero2_is_left_alone(ranks):
    for rank in ranks:
        run, alone = rank["zero2/fp32/with"], rank["zero2/fp32/without"]
        assert (run["losses"], run["param_sha256"]) == (alone["losses"], alone["param_sha256"])
        # acted counts optimizer steps, cumulatively in the scenario's order: none under ZeRO-2
        assert rank["zero2/fp32/acted"] == rank["zero0/bf16/acted"]
        assert (rank["zero0/fp32/acted"] > 0) is AFFECTED


def test_status_follows_the_range(ranks):
    state = ranks[0]["status"]
    assert state["state"] == ("applied" if AFFECTED else "skipped"), state


def test_only_whole_matrices_of_muon_groups_are_updated():
    import torch

    from zeroshim.patches.muon_newton_schulz import whole_matrices

    def param(*shape, grad=True):
        p = torch.nn.Parameter(torch.zeros(*shape))
        p.grad = torch.ones(*shape) if grad else None
        return p

    matrix, flat, no_grad, adam = param(4, 4), param(16), param(4, 4, grad=False), param(4, 4)
    optimizer = torch.optim.SGD([{"params": [matrix, flat, no_grad], "use_muon": True},
                                 {"params": [adam], "use_muon": False}], lr=0.1)
    assert [p for _, p in whole_matrices(optimizer)] == [matrix]


IMPORT_ORDER = """
import zeroshim, torch, deepspeed
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

def step():
    p = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
    optimizer = MuonWithAuxAdam([dict(params=[p], use_muon=True, lr=0.1, momentum=0.95, weight_decay=0.0)])
    before = p.detach().clone()
    p.grad = torch.ones(4, 4)
    optimizer.step()
    return p.detach() - before

sgd = -0.1 * torch.ones(4, 4)
first = step()
print(zeroshim.stats("muon_newton_schulz")["acted"], torch.allclose(first, sgd))
zeroshim.unpatch("muon_newton_schulz")
after_undo = step()
print(zeroshim.stats("muon_newton_schulz")["acted"], torch.allclose(after_undo, sgd))
zeroshim.apply("muon_newton_schulz")
again = step()
print(zeroshim.stats("muon_newton_schulz")["acted"], torch.equal(again, first))
"""


@pytest.mark.skipif(not AFFECTED, reason="the patch installs nothing on this DeepSpeed")
def test_zeroshim_imported_first_undo_and_apply_again():
    """With zeroshim imported before the first optimizer (as users import it), torch puts its own wrapper on the
    class's ``step``: the patch must still act once a step, stop at undo, and act once a step again after apply (it
    hooks each optimizer, not ``step``)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_ORDER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")[-4:-1]
    # acted once, not SGD; after undo: nothing, SGD; applied again: once, the first step's update again
    assert lines == ["1 False", "0 True", "1 True"], out.stdout
