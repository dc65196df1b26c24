"""Patch muon_frozen_params against real DeepSpeed (patches/muon_frozen_params/scenario.py), 2 ranks: DeepSpeed's Muon
optimizer from the config on a partly frozen model, ``model_parameters=model.parameters()``."""

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sdists (0.17.5 has no Muon; 0.17.6, 0.18.2 and 0.18.6 put frozen parameters in
# Muon's groups; 0.18.7 and 0.18.8 do not), not read from the patch's gate: tests/test_inert_gates.py compares the two
AFFECTED = not ds_before("0.17.6") and ds_before("0.18.7")
HAS_MUON = not ds_before("0.17.6")
CASES = ("zero2/adapters", "zero0/frozen_embed", "zero2/mixed")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not HAS_MUON:
        pytest.skip("this DeepSpeed has no Muon optimizer (from 0.17.6)")
    return torchrun("muon_frozen_params", 2, tmp_path_factory.mktemp("muon_frozen"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("muon_frozen_params").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed leaves frozen parameters out of Muon's groups itself: {without}")
    assert proven, (without, with_)


def test_the_reference_trains_and_keeps_frozen_parameters(ranks):
    for rank in ranks:
        for case in CASES:
            ref = rank[f"{case}/reference"]
            assert ref["ok"], (case, ref.get("error"))
            assert ref["frozen_moved"] == [], case


def test_without_zeroshim(ranks):
    for rank in ranks:
        adapters, zero0 = rank["zero2/adapters/without"], rank["zero0/frozen_embed/without"]
        if AFFECTED:
            assert not adapters["ok"] and "torch.cat(): expected a non-empty list of Tensors" in adapters["error"]
            # silent: it trains, and the frozen embedding and norm weight decay by weight_decay each step (the norm's
            # bias is 0: decayed, it stays 0)
            assert zero0["ok"] and zero0["frozen_moved"] == ["embed.weight", "norm.weight"], zero0
            assert zero0["param_sha256"] != rank["zero0/frozen_embed/reference"]["param_sha256"]
        else:
            for case in CASES:
                run, ref = rank[f"{case}/without"], rank[f"{case}/reference"]
                assert (run["losses"], run["param_sha256"]) == (ref["losses"], ref["param_sha256"]), case


def test_with_zeroshim_as_the_reference_bit_for_bit(ranks):
    for rank in ranks:
        for case in CASES:
            with_, ref = rank[f"{case}/with"], rank[f"{case}/reference"]
            assert with_["ok"], (case, with_.get("error"))
            assert (with_["losses"], with_["param_sha256"], with_["frozen_moved"]) == \
                (ref["losses"], ref["param_sha256"], []), case


def test_it_acts_only_where_it_changes_something(ranks):
    for rank in ranks:
        acted = [rank[f"{case}/acted"] for case in CASES]  # cumulative, in CASES order
        assert acted == ([1, 2, 2] if AFFECTED else [0, 0, 0]), acted
        mixed = rank["zero2/mixed/with"], rank["zero2/mixed/without"]
        assert mixed[0]["param_sha256"] == mixed[1]["param_sha256"]


def test_status_follows_the_range(ranks):
    state = ranks[0]["status"]
    assert state["state"] == ("applied" if AFFECTED else "skipped"), state


def _params(*spec):
    """Parameters for the decision alone (no DeepSpeed): ``(use_muon, requires_grad)`` each."""
    import torch

    out = []
    for muon, trains in spec:
        p = torch.nn.Parameter(torch.zeros(2, 2) if muon else torch.zeros(2), requires_grad=trains)
        p.use_muon = muon
        out.append(p)
    return out


@pytest.mark.parametrize("spec, stage, decay, acts", [
    (((True, True), (False, False)), 2, 0.1, True),    # LoRA: the Adam group has no trainable member
    (((True, False), (False, True)), 1, 0.0, True),    # a trained head alone: the Muon group is empty
    (((True, True), (True, False), (False, True), (False, False)), 2, 0.1, False),  # ZeRO keeps the trainable
    (((True, True), (False, False)), 0, 0.1, True),    # frozen Adam members decay
    (((True, True), (False, False)), 0, 0, False),     # no decay: a zero-gradient Adam step changes nothing
    (((True, False), (True, True), (False, True)), 0, 0, True),  # a frozen Muon matrix fails the step
    (((True, True), (False, True)), 2, 0.1, False),    # nothing frozen
    (((True, False), (False, False)), 2, 0.1, False),  # nothing trainable: DeepSpeed's own error
    (((True, True), (False, False)), 3, 0.1, False),   # ZeRO-3: DeepSpeed refuses Muon
])
@pytest.mark.parametrize("half", [False, True])
def test_the_decision(spec, stage, decay, acts, half):
    """``half``: fp16/bf16, where without ZeRO DeepSpeed's FP16_UnfusedOptimizer gives a frozen parameter a zero
    gradient: a frozen Muon matrix no longer fails, only the weight decay moves frozen parameters."""
    from zeroshim.patches.muon_frozen_params import trainable_only

    if half and stage == 0 and decay == 0:
        acts = False
    params = _params(*spec)
    found = trainable_only(params, stage, decay, half)
    assert (found is not None) == acts, found
    if acts:
        assert found[0] == [p for p in params if p.requires_grad]


def test_param_groups_and_missing_flags_are_left_to_deepspeed():
    from zeroshim.patches.muon_frozen_params import trainable_only

    params = _params((True, True), (False, False))
    assert trainable_only([{"params": params}], 2, 0.1) is None
    del params[1].use_muon
    assert trainable_only(params, 2, 0.1) is None
