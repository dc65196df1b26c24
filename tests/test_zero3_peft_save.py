"""Patch zero3_peft_save against real DeepSpeed, transformers and peft (patches/zero3_peft_save/scenario.py),
2 ranks: a LoRA adapter saved after ZeRO-3 training by HF Trainer and by a custom loop."""

import pytest

import zeroshim
from harness import load_proof, torchrun
from zeroshim import _versions

pytestmark = pytest.mark.deepspeed
NAME = "zero3_peft_save"
PATCH = zeroshim.get_patch(NAME)
# transformers 5.0.0 gathers a peft model's trainable parameters itself (#41416)
TRAINER_AFFECTED = _versions.base_version(_versions.installed("transformers")) < _versions.base_version("5.0.0")
proof = load_proof("zero3_peft_save")  # the judge zeroshim prove uses, and its helpers


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("peft_save"))["ranks"]


def test_proof(ranks):
    without, with_, proven = proof.judge(ranks)
    assert proven, (without, with_)


def test_trainer_save(ranks):
    for rank in ranks:
        ref, out, fix = (rank[k]["trainer"] for k in ("reference", "without", "with"))
        if TRAINER_AFFECTED:
            assert proof.empty(out), out.get("shapes")  # adapter_model.safetensors with no tensors
        else:  # transformers >= 5: saved whole without zeroshim, and unchanged with it
            assert out["sha256"] == ref["sha256"] == fix["sha256"]
        assert proof.whole(fix) and fix["sha256"] == ref["sha256"]  # = the 16-bit-gather save, bit for bit
        assert fix["losses"] == ref["losses"] == out["losses"]


def test_trainer_adapter_equals_zero2(ranks):
    """ZeRO-2 and ZeRO-3 do not train bit for bit alike; the saved adapters agree to float32 rounding."""
    for rank in ranks:
        zero2, fix = rank["zero2"], rank["with"]["trainer"]
        assert zero2["ok"] and zero2["shapes"] == fix["shapes"]
        worst = max(abs(a - b) for key in zero2["values"] for a, b in zip(zero2["values"][key], fix["values"][key]))
        assert worst < 1e-6, worst


def test_custom_loop_saves(ranks):
    for rank in ranks:
        ref, out, fix = (rank[k]["custom"] for k in ("reference", "without", "with"))
        for case in ("every_rank", "rank0_only", "every_rank_again"):
            assert proof.placeholders(out[case]), (case, out[case].get("shapes"))
        for case in ("every_rank", "every_rank_again"):  # lone saves leave later saves working
            # the reference: the same engine saved inside GatheredParameters by hand, in the same run
            assert fix[case]["sha256"] == fix["every_rank_by_hand"]["sha256"], case
        # rank 0 alone: nothing to gather with, so peft's file, as without zeroshim, and its check says so
        assert fix["rank0_only"]["shapes"] == out["rank0_only"]["shapes"]
        assert proof.verdicts(fix["rank0_only"]) == (["placeholders"] if rank is ranks[0] else [])
        # OpenRLHF's save (rank 0 alone, then its own gathered adapter_model.bin over peft's file): the same
        # whole adapter both ways, no error with zeroshim, and the check finds it replaced
        for run in (out, fix):
            assert "error" not in run["rank0_overwrite"], run["rank0_overwrite"]["error"]
            assert run["rank0_overwrite"]["file"] == "adapter_model.bin"
            assert run["rank0_overwrite"]["sha256"] == run["every_rank_by_hand"]["sha256"]
        assert proof.verdicts(fix["rank0_overwrite"]) == (["replaced"] if rank is ranks[0] else [])
        # rank 1 alone: peft writes placeholders; zeroshim skips that write (rank 0 writes the job's files)
        assert proof.placeholders(out["rank1_only"]) and not fix["rank1_only"].get("written")
        # every rank "main" (HF Trainer on a CPU-only accelerate): rank 1's placeholder write cannot land over
        # rank 0's whole file with zeroshim (without it, whichever rank writes last wins)
        assert "error" not in fix["both_main"], fix["both_main"]
        assert fix["both_main"]["sha256"] == fix["every_rank_by_hand"]["sha256"]
        # LoRA tensors below stage3_param_persistence_threshold are never partitioned: nothing to do
        assert out["persistent"]["sha256"] == fix["persistent"]["sha256"]


def test_status_and_action(ranks):
    for index, rank in enumerate(ranks):
        assert rank["status"]["state"] == "applied", rank["status"]
        # two gathered saves on every rank; two lone saves on rank 0 (peft's file) and two on rank 1 (skipped:
        # rank 1 alone, and the all-"main" save); the Trainer's adapter
        # replaced on the saving rank where transformers drops it
        assert rank["stats"] == {"gathered": 2, "alone": 2, "skipped": 0 if index == 0 else 2,
                                 "trainer_gathered": int(TRAINER_AFFECTED and index == 0)}
        assert ("wrapped" in rank["trainer_target"]) == TRAINER_AFFECTED


def test_an_unreadable_trainer_source_never_turns_the_patch_off(monkeypatch):
    """A build without .py files: the transformers version decides whether Trainer gathers peft models itself;
    the patch is never skipped as "target changed" for want of the source."""
    import inspect

    import transformers.trainer

    from zeroshim._patcher import Patcher
    from zeroshim.patches import zero3_peft_save as patch

    def unreadable(obj):
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", unreadable)
    monkeypatch.setattr(patch, "_where", {})
    patcher = Patcher(NAME)
    try:
        patch.patch_trainer(transformers.trainer, patcher)  # raises TargetChanged if the source decided
        said = patch._where["trainer"]
        assert said == ("Trainer.save_model and Trainer._save wrapped" if TRAINER_AFFECTED
                        else "Trainer.save_model gathers peft models under ZeRO-3 itself")
    finally:
        patcher.undo()
