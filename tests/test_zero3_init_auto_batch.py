"""Patch zero3_init_auto_batch against real DeepSpeed and transformers (patches/zero3_init_auto_batch/scenario.py),
2 ranks: ``deepspeed.zero.Init`` given a config with ``"auto"`` or no batch sizes."""

import pytest

import zeroshim
from harness import load_proof, matches, torchrun

pytestmark = pytest.mark.deepspeed
NAME = "zero3_init_auto_batch"
PATCH = zeroshim.get_patch(NAME)
proof = load_proof("zero3_init_auto_batch")  # the judge zeroshim prove uses


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun(NAME, 2, tmp_path_factory.mktemp("autobatch"))["ranks"]


def test_proof(ranks):
    without, with_, proven = proof.judge(ranks)
    assert proven, (without, with_)


def test_without_zeroshim_zero_init_refuses_the_config(ranks):
    for rank in ranks:
        for case in proof.acted(rank):  # (DeepSpeed < 0.17.1 refuses hf_precision for its fp16 and bf16 "auto")
            without = rank["without"][case]
            assert not without["ok"], case
            # "auto": DeepSpeed compares or multiplies the strings; none given: its own assertion
            signature = PATCH.signatures[1 if case == "hf_none" else 0]
            assert all(matches(pattern, without["traceback"]) for pattern in signature), (case, without["error"])


def test_with_zeroshim_the_model_is_the_one_numbers_give(ranks):
    for rank in ranks:
        for case in proof.acted(rank):
            with_, reference = rank["with"][case], rank["reference"][case]
            assert with_["ok"] and reference["ok"], (case, with_.get("error"), reference.get("error"))
            assert with_["sha256"] == reference["sha256"] and with_["shapes"] == reference["shapes"], case
            assert with_["zero3"] and with_["partitioned"] == reference["partitioned"] > 0, case
            # the caller's dict and file, and the copy transformers registered, still hold their "auto"s
            assert with_["user_config_kept"], case
        assert rank["with"]["hf_auto"]["losses"] == rank["reference"]["hf_auto"]["losses"]


def test_precision_auto_is_left_to_deepspeed_before_0_17(ranks):
    """DeepSpeed < 0.17.1 reads ``"enabled": "auto"`` in fp16/bf16 as on: zero.Init would build the model in that
    dtype, so there the config keeps DeepSpeed's error; from 0.17.1 "auto" is off, and it loads as the others."""
    for rank in ranks:
        with_, without = rank["with"]["hf_precision"], rank["without"]["hf_precision"]
        if rank["precision_models"]:
            assert with_["ok"] and with_["sha256"] == rank["reference"]["hf_precision"]["sha256"]
        else:
            assert not with_["ok"] and with_["error"].split(" @ ")[0] == without["error"].split(" @ ")[0]


def test_numbers_that_do_not_fit_keep_deepspeeds_error(ranks):
    for rank in ranks:
        for mode in ("without", "with"):
            wrong = rank[mode]["wrong"]
            assert not wrong["ok"] and "Check batch related parameters" in wrong["error"], (mode, wrong["error"])


def test_acted_once_per_refused_config(ranks):
    for rank in ranks:
        assert rank["status"]["state"] == "applied", rank["status"]
        auto = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto"}
        two = {k: v for k, v in auto.items() if k != "train_batch_size"}
        given = [auto, auto, two, {}, auto, {**auto, "train_batch_size": 4}]
        assert rank["given"] == given + ([auto] if rank["precision_models"] else []), rank["given"]


def test_what_is_refused_and_what_is_passed_on():
    from zeroshim.patches import zero3_init_auto_batch as patch

    assert patch.refused({"train_micro_batch_size_per_gpu": "auto"})
    assert patch.refused({"zero_optimization": {"stage": 3}})
    assert not patch.refused({"train_micro_batch_size_per_gpu": 2})
    assert not patch.refused({"train_batch_size": 8, "gradient_accumulation_steps": 2})
    assert not patch.refused({"elasticity": {"enabled": True}, "train_micro_batch_size_per_gpu": "auto"})
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}
    numbers = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    assert patch.accepted(config) == {"gradient_clipping": "auto", "zero_optimization": {"stage": 3}, **numbers}
    # valid at any world size (a train_batch_size kept could not be divided among 3 or 8 ranks)
    assert patch.accepted({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto"}) == numbers
    assert config["train_batch_size"] == "auto"  # a copy
    assert patch.precision_auto({"bf16": {"enabled": "auto"}}) and not patch.precision_auto({"bf16": {"enabled": 0}})


def test_a_json_file_deepspeed_refuses_for_duplicate_keys_is_left_to_it(tmp_path):
    from zeroshim.patches import zero3_init_auto_batch as patch

    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}, '
                    '"zero_optimization": {"stage": 2}}')
    assert patch._read(str(path)) is None  # DeepSpeed's "Duplicate keys" error stays
    path.write_text('{"train_micro_batch_size_per_gpu": "auto"}')
    assert patch._read(str(path)) == {"train_micro_batch_size_per_gpu": "auto"}


def test_doctor_names_the_config():
    from zeroshim import _cli

    auto = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}
    findings = [f for f in _cli.check_config(auto) if f["patch"] == NAME]
    assert len(findings) == 1 and findings[0]["level"] == "info", findings
    assert not [f for f in _cli.check_config({**auto, "train_micro_batch_size_per_gpu": 2}) if f["patch"] == NAME]
    assert not [f for f in _cli.check_config({**auto, "zero_optimization": {"stage": 2}}) if f["patch"] == NAME]
