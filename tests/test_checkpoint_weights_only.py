"""Patch checkpoint_weights_only against real DeepSpeed (patches/checkpoint_weights_only/scenario.py),
2 ranks, ZeRO-2 and ZeRO-3: save, resume, continue; zero_to_fp32; a foreign global."""

import pytest

import zeroshim
from harness import ds_before, load_proof, matches, torchrun
from zeroshim import _versions

pytestmark = pytest.mark.deepspeed
PATCH = zeroshim.get_patch("checkpoint_weights_only")
TORCH_WEIGHTS_ONLY = _versions.base_version(_versions.installed("torch")) >= _versions.base_version("2.6")
AFFECTED = ds_before("0.16.0") and TORCH_WEIGHTS_ONLY


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("checkpoint_weights_only", 2, tmp_path_factory.mktemp("resume"))["ranks"]


def test_status_follows_the_range(ranks):
    assert ranks[0]["status"]["state"] == ("applied" if AFFECTED else "skipped"), ranks[0]["status"]


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_fails_without_zeroshim_where_affected(ranks, stage):
    for rank in ranks:
        run = rank[f"resume/without/z{stage}"]
        if AFFECTED:
            assert not run["ok"] and matches(PATCH.signatures[0], run["error"]), run.get("error")
        else:
            assert run["ok"] and run["losses"] == rank[f"straight/z{stage}"]["losses"], run.get("error")


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_with_zeroshim_continues_exactly_as_the_uninterrupted_run(ranks, stage):
    for rank in ranks:
        run, straight = rank[f"resume/with/z{stage}"], rank[f"straight/z{stage}"]
        assert straight["ok"] and run["ok"], run.get("error")
        assert run["losses"] == straight["losses"]  # bit for bit, the 2 steps after the resume included


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_reads_the_checkpoint(ranks, stage):
    rank0 = ranks[0]
    with_ = rank0[f"fp32/with/z{stage}"]
    assert with_["ok"], with_.get("error")
    assert with_["names"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert with_["shapes"] == [[32], [32, 16], [4], [4, 32]]
    without = rank0[f"fp32/without/z{stage}"]
    assert without["ok"] != AFFECTED, without.get("error")


@pytest.mark.skipif(not AFFECTED, reason="zeroshim is not what loads here: DeepSpeed >= 0.16.0 passes "
                                          "weights_only=False itself (upstream's choice; zeroshim leaves it, as "
                                          "client_state may hold the user's own objects)")
@pytest.mark.parametrize("stage", [2, 3])
def test_a_foreign_global_is_still_refused(ranks, stage):
    for rank in ranks:
        run = rank[f"foreign/with/z{stage}"]
        assert not run["ok"], "a checkpoint carrying a foreign global was loaded"
        assert not run["marker_exists"], "unpickling the foreign global ran its function"
        # the first global the unpickler meets is refused (``getattr``, which the pickled
        # ``pathlib.Path.touch`` reduces through)
        assert "Unsupported global" in run["error"], run["error"]


def test_proof(ranks):
    """The judge `zeroshim prove` uses (patches/checkpoint_weights_only/proof.py) on this launch: the bug without
    zeroshim, the reference with it; where not affected, nothing to prove."""
    without, with_, proven = load_proof("checkpoint_weights_only").judge(ranks)
    assert proven == AFFECTED, (without, with_)
