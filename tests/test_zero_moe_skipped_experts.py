"""Patch zero_moe_skipped_experts against real DeepSpeed and the installed transformers' MoE blocks
(patches/zero_moe_skipped_experts/scenario.py), 2 ranks routing to different experts, ZeRO-1 and ZeRO-2 against
ZeRO-0."""

from importlib.metadata import version

import pytest
from packaging.version import Version

from harness import load_proof, torchrun

pytestmark = pytest.mark.deepspeed
NAME = "zero_moe_skipped_experts"
TF = Version(version("transformers"))
# which of the scenario's transformers blocks skip experts without tokens, written here from the wheels read for
# benchmarks/RESULTS.md section 43 (not from the patch's reading of the source): Qwen3-MoE 4.53-4.57, Jamba,
# DeepSeek-V2 and -V3 every 4.x release that has them; 5.x fuses all four.  RemoteMoe (remote code) skips everywhere.
SKIPS = {"Qwen3MoeSparseMoeBlock": Version("4.53") <= TF < Version("5"), "JambaSparseMoeBlock": TF < Version("5"),
         "DeepseekV3MoE": TF < Version("5"), "DeepseekV2MoE": TF < Version("5"), "RemoteMoe": True,
         # built from 5.0 only (4.x loops over a `.tolist()` selection: refused, warned about; the unit test)
         "SwitchTransformersSparseMLP": True}
# the module that runs the skip: transformers 5's Switch block calls its experts container, whose forward loops
MARKED_AS = {"SwitchTransformersSparseMLP": "SwitchTransformersExperts"}
RUNS = ("with/zero1", "with/zero2", "with/zero1/default", "with/zero2/default", "same/with")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("moe12"))["ranks"]


def test_proof(ranks):
    """The judge `zeroshim prove` uses: without zeroshim ZeRO-1 and ZeRO-2 train silently to other parameters
    than ZeRO-0; with zeroshim to ZeRO-0's, bit for bit; where the ranks route alike nothing changes."""
    without, with_, proven = load_proof("zero_moe_skipped_experts").judge(ranks)
    assert proven, (without, with_)


def test_without_zeroshim_the_ranks_agree_on_the_wrong_parameters(ranks):
    """Silent: no error, and both ranks end with the same (wrong) parameters, so no check across ranks sees it."""
    for key in ("without/zero1", "without/zero2"):
        assert ranks[0][key]["param_sha256"] == ranks[1][key]["param_sha256"] != ranks[0]["reference"]["param_sha256"]


def test_with_zeroshim_every_configuration_equals_zero0(ranks):
    for rank in ranks:
        assert rank["status"]["state"] == "applied"
        for key in RUNS[:4]:
            assert rank[key]["ok"], (key, rank[key].get("error"))
            assert (rank[key]["losses"], rank[key]["param_sha256"]) == \
                (rank["reference"]["losses"], rank["reference"]["param_sha256"]), key


def test_a_real_moe_model_routing_on_its_own_trains_as_zero0(ranks):
    """transformers' Qwen3MoeForCausalLM with its own router, 3 tokens a rank: ZeRO-2 with zeroshim ends where
    ZeRO-0 does, bit for bit (without zeroshim gloo aborts there: benchmarks/RESULTS.md section 45)."""
    if Version("4.51") > TF:
        pytest.skip(f"transformers {TF} has no Qwen3-MoE")
    for rank in ranks:
        assert rank["natural/with"]["ok"], rank["natural/with"].get("error")
        assert (rank["natural/with"]["losses"], rank["natural/with"]["param_sha256"]) == \
            (rank["natural/reference"]["losses"], rank["natural/reference"]["param_sha256"])


def test_where_no_rank_disagrees_nothing_changes(ranks):
    """Both ranks route to expert 0; experts 1-3 get no token anywhere (ZeRO-1/2 step them with zeros either
    way): the run with zeroshim, where every expert runs, equals the run without bit for bit."""
    for rank in ranks:
        assert (rank["same/with"]["losses"], rank["same/with"]["param_sha256"]) == \
            (rank["same/without"]["losses"], rank["same/without"]["param_sha256"])


def test_exactly_the_blocks_that_skip_are_rewritten(ranks):
    """Every block of the installed transformers that skips (SKIPS, from the wheels) runs every expert; blocks
    that do not skip (5.x's fused experts, 4.49's Mixtral-style loops) are left alone."""
    for rank in ranks:
        built = [name for name, how in rank["reference"]["blocks"].items() if how == "built"]
        expected = sorted(MARKED_AS.get(name, name) for name in built if SKIPS[name])
        for key in RUNS:
            assert rank[key]["marked"] == expected, key
        natural = rank["natural/with"].get("marked", [])
        assert natural == (["Qwen3MoeSparseMoeBlock"] * 2 if SKIPS["Qwen3MoeSparseMoeBlock"] else [])
        assert rank["stats"]["blocks"] == len(expected) * len(RUNS) + len(natural)
        assert rank["stats"]["unreadable"] == 0
        assert rank["with/zero0"]["marked"] == []  # ZeRO-0 reduces missing gradients as zeros itself


def test_ranks_that_read_the_blocks_differently_stop_naming_them(tmp_path):
    """Rank 1 cannot read one block's source (a node whose install ships none, or other model code): marking on
    rank 0 only would reduce other gradients on each rank, so every rank stops before its engine is built, naming
    the ranks, instead of training."""
    ranks = torchrun(NAME, 2, tmp_path, "--split")["ranks"]
    for rank in ranks:
        assert not rank["split"]["ok"]
        assert "RanksDisagree" in rank["split"]["error"]
        assert "the ranks read the MoE blocks differently" in rank["split"]["error"]
