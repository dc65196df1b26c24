"""Patch zero3_frozen_recompute against real DeepSpeed: ZeRO-3 + peft LoRA +
non-reentrant gradient checkpointing (patches/zero3_frozen_recompute/scenario.py at 1 and 2
ranks; patches/zero3_frozen_recompute/scenario_trainer.py with HF Trainer, 2 ranks, 2 epochs).

Where DeepSpeed has the bug (< 0.19.3) the runs without zeroshim must fail
with the upstream error; where it is fixed the patch must report itself
skipped and the same runs pass.  Numerics: the checkpointed runs must equal
the run without checkpointing exactly (same losses, same parameter shards),
and their losses must equal those of DeepSpeed 0.19.8 (upstream's fix) within
bf16 tolerance.  Memory: no parameter left gathered after a step, and no more
gathered at any point of backward than DeepSpeed 0.19.8 holds.
"""

import json
import math
import os
from pathlib import Path

import pytest

import zeroshim
from harness import PORTABLE_ISA, clean_env, ds_before, load_proof, matches, torchrun

pytestmark = pytest.mark.deepspeed
PATCH = zeroshim.get_patch("zero3_frozen_recompute")
AFFECTED = ds_before("0.19.3")
# Recorded with DeepSpeed 0.19.8 (transformers 5.23, peft 0.21), no zeroshim, by
# tests/fixtures/make_lora_recompute_fixture.py with torch's CPU kernels held to AVX2
# (harness.PORTABLE_ISA, as every run here); test_fixture_is_reproduced checks it there.
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "lora_recompute_ds0.19.8.json").read_text())
BF16_RTOL = 2.0 ** -8  # half a bf16 ulp at 1.0
MODES = ("nonreentrant", "reentrant")


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def ranks(request, tmp_path_factory):
    return torchrun("zero3_frozen_recompute", request.param, tmp_path_factory.mktemp(f"lora{request.param}"),
                    env=clean_env(**PORTABLE_ISA))["ranks"]


def test_status(ranks):
    state = ranks[0]["status"][PATCH.name]
    assert state["state"] == ("applied" if AFFECTED else "skipped"), state


def test_fails_without_zeroshim_where_upstream_has_the_bug(ranks):
    for rank in ranks:
        run = rank["without/nonreentrant"]
        if AFFECTED:
            assert not run["ok"], "LoRA + non-reentrant checkpointing trained without zeroshim: the test cannot fail"
            assert matches(PATCH.signatures[0], run["error"]), run["error"]
        else:
            assert run["ok"], run.get("error")  # upstream's fix (0.19.3)


@pytest.mark.parametrize("mode", MODES)
def test_trains_with_zeroshim_exactly_as_without_checkpointing(ranks, mode):
    for rank in ranks:
        ref, run = rank["reference"], rank[f"with/{mode}"]
        assert ref["ok"], ref.get("error")
        assert run["ok"], run.get("error")
        assert run["losses"] == ref["losses"]
        assert run["param_sha256"] == ref["param_sha256"]


@pytest.mark.parametrize("mode", MODES)
def test_losses_match_deepspeed_0_19_8(ranks, mode):
    expected = FIXTURE["runs"]["without/nonreentrant"][str(len(ranks))]
    for rank, want in zip(ranks, expected):
        got = rank[f"with/{mode}"]["losses"]
        assert len(got) == len(want["losses"])
        for g, w in zip(got, want["losses"]):
            assert math.isclose(g, w, rel_tol=BF16_RTOL), (got, want["losses"])


@pytest.mark.parametrize("mode", MODES)
def test_nothing_left_gathered(ranks, mode):
    for rank in ranks:
        run, ref = rank[f"with/{mode}"], rank["reference"]
        assert run["left_gathered_after_step"] == [0] * len(run["losses"])
        # What DeepSpeed itself leaves gathered between backward and step
        # (this release's first module, without checkpointing), and no more.
        assert all(a <= b for a, b in zip(run["left_gathered_after_backward"], ref["left_gathered_after_backward"]))


@pytest.mark.parametrize("mode", MODES)
def test_holds_no_more_than_upstream(ranks, mode):
    """Peak of gathered parameter elements during backward (prefetch off):
    one checkpointed block's frozen weights at a time, as DeepSpeed 0.19.8 -
    not every frozen weight until the end of backward."""
    expected = FIXTURE["runs"]["without/nonreentrant"][str(len(ranks))]
    for rank, want in zip(ranks, expected):
        run = rank[f"with/{mode}"]
        assert run["peak_gathered_numel"] <= want["peak_gathered_numel"], (run["peak_gathered_numel"], want)
        assert run["peak_gathered_numel"] < run["total_numel"] // 2


def test_released_at_end_of_backward_when_post_backward_hooks_never_fire(ranks):
    """TailNormNet: the first block's input needs no grad, so the post-backward
    hooks of the submodule that owned the re-run never fire.  What it kept is
    released at the end of backward: nothing more is left gathered than
    DeepSpeed leaves without checkpointing."""
    expected = FIXTURE["runs"]["tail_norm/without"][str(len(ranks))]
    for rank, want in zip(ranks, expected):
        run, ref, without = rank["tail_norm/with"], rank["tail_norm/reference"], rank["tail_norm/without"]
        assert ref["ok"], ref.get("error")
        assert run["ok"], run.get("error")
        if AFFECTED:
            assert not without["ok"] and matches(PATCH.signatures[0], without["error"]), without
            assert run["patch_stats"]["leftover_params"] > 0  # the end-of-backward path ran
        else:
            assert without["ok"], without.get("error")
        assert run["losses"] == ref["losses"]
        assert run["param_sha256"] == ref["param_sha256"]
        assert run["left_gathered_after_step"] == [0] * len(run["losses"])
        assert all(a <= b for a, b in zip(run["left_gathered_after_backward"], ref["left_gathered_after_backward"]))
        assert run["peak_gathered_numel"] <= want["peak_gathered_numel"]
        assert all(math.isclose(g, w, rel_tol=BF16_RTOL) for g, w in zip(run["losses"], want["losses"]))


def test_reentrant_recompute_is_left_alone(ranks):
    """With nonreentrant_checkpoint off, a reentrant checkpoint's re-run (no
    metadata check; works on every release) is not this patch's business: it
    must gather exactly what it gathers without zeroshim, not keep frozen
    weights for the model's whole backward."""
    for rank in ranks:
        kept, without, ref = rank["with/reentrant_kept"], rank["without/reentrant"], rank["reference"]
        assert without["ok"], without.get("error")
        assert kept["ok"], kept.get("error")
        assert kept["peak_gathered_numel"] == without["peak_gathered_numel"]
        assert kept["losses"] == without["losses"] == ref["losses"]
        assert kept["param_sha256"] == ref["param_sha256"]


def test_fixture_is_reproduced(ranks):
    """In the 0.19.8 environment the fixture's runs are these runs."""
    if ranks[0]["versions"]["deepspeed"] != FIXTURE["versions"]["deepspeed"]:
        pytest.skip(f"fixture recorded with DeepSpeed {FIXTURE['versions']['deepspeed']}")
    if PORTABLE_ISA != FIXTURE["env"]:
        pytest.skip("the fixture was recorded with torch's CPU kernels held to AVX2, which this CPU lacks")
    for name, per_nproc in FIXTURE["runs"].items():
        for rank, want in zip(ranks, per_nproc[str(len(ranks))]):
            assert rank[name]["losses"] == want["losses"]
            assert rank[name]["peak_gathered_numel"] == want["peak_gathered_numel"]


@pytest.mark.skipif(not AFFECTED, reason="patch skipped: DeepSpeed has upstream's fix")
def test_unpatch_restores_the_originals_exactly():
    po = pytest.importorskip("deepspeed.runtime.zero.parameter_offload")
    s3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    from zeroshim._patcher import is_patched_by
    from zeroshim.patches import zero3_frozen_recompute as patch

    targets = [(po.DeepSpeedZeRoOffload, name) for name in (
        "pre_sub_module_backward_function", "pre_sub_module_forward_function", "post_sub_module_backward_function")]
    epilogue = "backward_epilogue" if hasattr(s3.DeepSpeedZeroOptimizer_Stage3, "backward_epilogue") else "backward"
    targets.append((s3.DeepSpeedZeroOptimizer_Stage3, epilogue))
    assert zeroshim.status()[PATCH.name].state == "applied"
    originals = {}
    for owner, name in targets:
        assert is_patched_by(vars(owner)[name], PATCH.name), name
        originals[name] = vars(owner)[name].__wrapped__
    patch._states[object.__new__(po.DeepSpeedZeRoOffload)] = patch._Owners()  # state of a backward in flight
    zeroshim.unpatch(PATCH.name)
    try:
        for owner, name in targets:
            assert vars(owner)[name] is originals[name], name
        assert len(patch._states) == 0
    finally:
        zeroshim.apply(PATCH.name)
    assert zeroshim.status()[PATCH.name].state == "applied"


# -- HF Trainer ------------------------------------------------------------------------
# The Trainer form depends on transformers (its checkpointing default, how it builds the engine): one release per
# pinned transformers; ds0.16.9 pins ds0.14.1's 4.49 and peft 0.14, and the DeepSpeed side is proven in every
# release by the scenario above.
TRAINER_ENVS = ("ds0.14.1", "ds0.19.2", "ds0.19.8")


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    if os.environ.get("ZSTEST_ENV", TRAINER_ENVS[0]) not in TRAINER_ENVS:
        pytest.skip(f"the Trainer form runs in {', '.join(TRAINER_ENVS)}: one release per pinned transformers "
                    "(ds0.16.9 shares ds0.14.1's 4.49)")
    runs = {}
    for name, flags, extra in (("reference", ["--reference"], {}), ("without", ["--without"], {}),
                               ("zeroshim", ["--zeroshim"], {}),
                               ("patch_off", ["--zeroshim"], {PATCH.flag: "off"})):
        runs[name] = torchrun("zero3_frozen_recompute/scenario_trainer.py", 2, tmp_path_factory.mktemp(name), *flags,
                              env=clean_env(**extra))["ranks"]
    return runs


def test_trainer_without_zeroshim(trainer_runs):
    for rank in trainer_runs["without"]:
        if AFFECTED:
            assert not rank["run"]["ok"], "Trainer + LoRA + checkpointing trained: the test cannot fail"
            assert matches(PATCH.signatures[0], rank["run"]["error"]), rank["run"]["error"]
        else:
            assert rank["run"]["ok"], rank["run"].get("error")


def test_trainer_trains_two_epochs_with_zeroshim_as_without_checkpointing(trainer_runs):
    for patched, reference in zip(trainer_runs["zeroshim"], trainer_runs["reference"]):
        assert reference["run"]["ok"], reference["run"].get("error")
        run = patched["run"]
        assert run["ok"], run.get("error")
        assert run["epoch"] == 2.0 and run["global_step"] == 8  # 32 samples / (4 x 2 ranks) x 2 epochs
        assert run["losses"] == reference["run"]["losses"]
        assert run["param_sha256"] == reference["run"]["param_sha256"]


def test_trainer_with_this_patch_off_keeps_reentrant_where_affected(trainer_runs):
    """With this patch off, nonreentrant_checkpoint would trade transformers
    4.x's reentrant default for this patch's crash; it declares that it needs
    this patch (``Patch.needs``), so where the bug exists it keeps LoRA's
    modules reentrant instead, which trains."""
    for rank, reference in zip(trainer_runs["patch_off"], trainer_runs["reference"]):
        assert rank["status"][PATCH.name]["state"] in ("disabled", "skipped")
        assert rank["run"]["ok"], rank["run"].get("error")
        assert rank["run"]["losses"] == reference["run"]["losses"]
        assert rank["run"]["param_sha256"] == reference["run"]["param_sha256"]


def test_proof(ranks):
    """The judge `zeroshim prove` uses (patches/zero3_frozen_recompute/proof.py) on this launch: the bug without
    zeroshim, the reference with it; where not affected, nothing to prove."""
    without, with_, proven = load_proof("zero3_frozen_recompute").judge(ranks)
    assert proven == AFFECTED, (without, with_)
