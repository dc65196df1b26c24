"""Patch zero3_peft_save against real DeepSpeed, transformers and peft (patches/zero3_peft_save/scenario.py),
2 ranks: a LoRA adapter saved after ZeRO-3 training by HF Trainer and by a custom loop."""

import pytest

import zeroshim
from harness import load_proof, torchrun
from zeroshim import _versions

pytestmark = pytest.mark.deepspeed
NAME = "zero3_peft_save"
PATCH = zeroshim.get_patch(NAME)
# transformers 5.0.0 gathers a peft model's trainable parameters itself (#41416), and only those
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


EMBEDDINGS = ("base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight")


def test_trainer_saves_the_embeddings_peft_selects(ranks):
    """The vocabulary resized before LoRA (64 -> 68 tokens, embeddings frozen): peft saves the embeddings too
    (ZeRO-2 does).  Under ZeRO-3 transformers >= 5 gathers only the trainable tensors and leaves them out, silently
    (< 5: no tensors at all without the 16-bit gather, the whole model gathered with it); with zeroshim both
    gather settings write the file a by-hand gather of the whole model writes, bit for bit, and its embeddings are
    the ZeRO-2 run's (frozen: the same values)."""
    for rank in ranks:
        zero2 = rank["zero2_resized"]
        assert zero2["ok"] and set(EMBEDDINGS) <= set(zero2["shapes"]), zero2.get("error")
        for case in ("resized_off", "resized_on"):
            out, fix = rank["without"][case], rank["with"][case]
            assert out["ok"] and fix["ok"], (out.get("error"), fix.get("error"))
            assert proof.whole(fix) and fix["sha256"] == fix["by_hand"]["sha256"], case
            assert all(fix["values"][key] == zero2["values"][key] for key in EMBEDDINGS), case
            assert fix["losses"] == out["losses"], case
            if not TRAINER_AFFECTED:  # the bug: every LoRA tensor, no embedding, nothing said
                assert proof.lost_embeddings(out, fix), (case, sorted(out["shapes"]))
            elif case == "resized_off":
                assert proof.empty(out), out.get("shapes")
            else:  # the whole model gathered onto rank 0: a right file
                assert out["sha256"] == out["by_hand"]["sha256"]


def test_ms_swift_exclude_frozen_attribute_coexists(ranks):
    """ms-swift sets its own ``_zero3_consolidated_16bit_state_dict`` on the engine (exclude_frozen_parameters for
    peft models): without zeroshim that drops the resized embeddings too; with zeroshim the file is the by-hand
    gather's, and ms-swift's attribute is on the engine again after the save."""
    for rank in ranks:
        out, fix = rank["without"]["swift"], rank["with"]["swift"]
        assert out["ok"] and fix["ok"], (out.get("error"), fix.get("error"))
        assert proof.lost_embeddings(out, fix), sorted(out["shapes"])
        assert proof.whole(fix) and fix["sha256"] == fix["by_hand"]["sha256"]
        assert fix["swift_kept"] and out["swift_kept"]


def test_selection_where_peft_computes_on_what_it_saves():
    """AdaLoRA with a rank pattern indexes the tensors it saves: on ZeRO-3 placeholders (shape [0]) that raises, so
    the selection is not certain and takes every trainable tensor and both embeddings (never fails the save);
    plain LoRA is selected exactly (its LoRA tensors only)."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeroshim.patches import zero3_peft_save as patch

    def tiny():
        config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
        return LlamaForCausalLM(config)

    lora = peft.get_peft_model(tiny(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    selected, certain = patch.peft_selection(lora)
    assert certain and sorted(selected) == sorted(n for n, p in lora.named_parameters() if p.requires_grad)
    ada = peft.get_peft_model(tiny(), peft.AdaLoraConfig(init_r=4, target_r=2, total_step=10,
                                                         target_modules=["q_proj"]))
    ada.peft_config["default"].rank_pattern = {  # as AdaLoRA's allocator writes it: 2 of 4 ranks kept
        name.removeprefix("base_model.model."): [True, False, True, False]
        for name, _ in ada.named_parameters() if "lora_E" in name}
    for param in ada.parameters():
        if param.requires_grad:
            param.data = torch.empty(0)  # what ZeRO-3 leaves outside a gather
    selected, certain = patch.peft_selection(ada)
    embeddings = {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"}
    assert not certain and embeddings <= set(selected)
    assert {n for n, p in ada.named_parameters() if p.requires_grad} <= set(selected)


def test_custom_loop_plan_where_peft_computes_on_what_it_saves():
    """A custom loop's ``save_pretrained`` of an AdaLoRA model with a rank pattern: asking peft which placeholders
    it would return raises on the ZeRO-3 placeholders (shape [0]); the plan is then the superset (every trainable
    tensor and both embeddings), gathered before peft computes on the real tensors, instead of a stop."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("deepspeed")
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from peft.utils import save_and_load
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeroshim.patches import zero3_peft_save as patch

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    ada = peft.get_peft_model(LlamaForCausalLM(config), peft.AdaLoraConfig(init_r=4, target_r=2, total_step=10,
                                                                           target_modules=["q_proj"]))
    ada.peft_config["default"].rank_pattern = {  # as AdaLoRA's allocator writes it: 2 of 4 ranks kept
        name.removeprefix("base_model.model."): [True, False, True, False]
        for name, _ in ada.named_parameters() if "lora_E" in name}
    for i, param in enumerate(ada.parameters()):  # what ZeRO-3 leaves outside a gather
        param.data = torch.empty(0)
        param.ds_id, param.ds_status = i, ZeroParamStatus.NOT_AVAILABLE
    original = getattr(save_and_load.get_peft_model_state_dict, "__wrapped__",
                       save_and_load.get_peft_model_state_dict)
    with pytest.raises(Exception):
        original(ada)  # peft itself, on the placeholders
    plan = patch._placeholders(original, (ada,), {})
    named = {id(p): n for n, p in ada.named_parameters()}
    planned = {named[id(p)] for p in plan}
    assert {n for n, p in ada.named_parameters() if p.requires_grad} <= planned
    assert {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"} <= planned


def test_trainer_gathers_only_what_peft_writes(ranks):
    """What the saving rank's ``Trainer._save`` receives: with zeroshim only the tensors peft writes (the LoRA
    tensors; with the vocabulary resized, the embeddings too), in every case; without it, on transformers < 5
    with the 16-bit gather, every tensor of the model (the frozen base in host memory)."""
    rank = ranks[0]
    ref, fix = rank["reference"]["trainer"], rank["with"]["gather_on"]
    assert proof.whole(fix) and fix["sha256"] == ref["sha256"]
    lora = sum(proof.elements(shape) for shape in fix["shapes"].values())
    assert fix["received"] == [{"tensors": len(fix["shapes"]), "elements": lora}]
    if TRAINER_AFFECTED:
        assert ref["received"][0]["elements"] > 20 * lora, ref["received"]
    else:
        assert ref["received"] == fix["received"]
    for case in ("resized_off", "resized_on"):
        saved = rank["with"][case]
        assert saved["received"] == [{"tensors": len(saved["shapes"]),
                                      "elements": sum(proof.elements(s) for s in saved["shapes"].values())}]


def test_custom_loop_saves(ranks):
    for rank in ranks:
        ref, out, fix = (rank[k]["custom"] for k in ("reference", "without", "with"))
        for case in ("every_rank", "rank0_only", "every_rank_again", "every_rank_late"):
            assert proof.placeholders(out[case]), (case, out[case].get("shapes"))
        # a rank that comes late to a save on every rank (no barrier between) is waited for: never "alone"
        if rank is ranks[0]:
            assert fix["every_rank_late"]["seconds"] > rank["waits"]["late"] / 2, fix["every_rank_late"]["seconds"]
        for case in ("every_rank", "every_rank_again", "every_rank_late"):  # lone saves leave later saves working
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
        # a lone save stops waiting as soon as it sees the other rank wait in a barrier: it never waits out the
        # rendezvous (LONG_WAIT_S, 30 s, in the scenario; 60 s by default: what OpenRLHF's saves paid each)
        lone = {0: ("rank0_only", "rank0_overwrite"), 1: ("rank1_only", "both_main")}[ranks.index(rank)]
        for case in lone:
            assert fix[case]["seconds"] < rank["waits"]["long"] / 3, (case, fix[case]["seconds"])
        # beside another collective (no barrier) it cannot know, and waits the whole (shortened) time; then
        # peft's file, as a rank alone writes it, and its check
        beside = fix["beside_collective"]
        if rank is ranks[0]:
            assert beside["seconds"] >= rank["waits"]["short"], beside["seconds"]
            assert proof.placeholders(beside) and proof.verdicts(beside) == ["placeholders"]
        assert proof.placeholders(out["beside_collective"])
        # LoRA tensors below stage3_param_persistence_threshold are never partitioned: nothing to do
        assert out["persistent"]["sha256"] == fix["persistent"]["sha256"]


def test_status_and_action(ranks):
    for index, rank in enumerate(ranks):
        assert rank["status"]["state"] == "applied", rank["status"]
        # three gathered saves on every rank; three lone saves on rank 0 (peft's file) and two on rank 1 (skipped:
        # rank 1 alone, and the all-"main" save); the Trainer saves zeroshim gathered, counted where they are
        # written (rank 0): transformers < 5 without the 16-bit gather ("dropped": plain and resized) and with it
        # ("full": resized, resized with ms-swift's attribute, and plain); transformers >= 5 only the resized ones
        # ("frozen": both settings, and ms-swift's)
        saving = index == 0
        trainer = ({"trainer_dropped": 2, "trainer_full": 3, "trainer_frozen": 0} if TRAINER_AFFECTED
                   else {"trainer_dropped": 0, "trainer_full": 0, "trainer_frozen": 3})
        trainer = {k: v if saving else 0 for k, v in trainer.items()}
        assert rank["stats"] == {"gathered": 3, "alone": 3 if index == 0 else 2, "skipped": 0 if index == 0 else 2,
                                 "trainer_gathered": sum(trainer.values()), **trainer}
        assert "wrapped" in rank["trainer_target"]


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
        assert patch._where["trainer"].startswith("Trainer.save_model and Trainer._save wrapped")
        assert patch._where["trainer_kind"] == ("fallback" if TRAINER_AFFECTED else "gathers")
    finally:
        patcher.undo()
