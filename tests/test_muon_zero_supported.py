"""Patch muon_zero_supported against real DeepSpeed (patches/muon_zero_supported/scenario.py), 2 ranks: DeepSpeed's Muon
optimizer from the config under ZeRO-1 and ZeRO-2, without ``zero_allow_untested_optimizer``."""

import subprocess
import sys

import pytest

from harness import ds_before, load_proof, torchrun

pytestmark = pytest.mark.deepspeed
# written here from the tagged sdists (0.17.5 has no Muon; 0.17.6, 0.18.2, 0.18.3 and 0.18.4 look for it in a module
# none ships; 0.18.5 finds it), not read from the patch's gate: tests/test_inert_gates.py compares the two
AFFECTED = not ds_before("0.17.6") and ds_before("0.18.5")
HAS_MUON = not ds_before("0.17.6")
STAGES = ("zero1", "zero2")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not HAS_MUON:
        pytest.skip("this DeepSpeed has no Muon optimizer (from 0.17.6)")
    return torchrun("muon_zero_supported", 2, tmp_path_factory.mktemp("muon_zero"))["ranks"]


def test_proof(ranks):
    without, with_, proven = load_proof("muon_zero_supported").judge(ranks)
    if not AFFECTED:
        assert not proven, (without, with_)
        pytest.skip(f"this DeepSpeed's ZeRO check accepts Muon without zeroshim: {without}")
    assert proven, (without, with_)


def test_the_reference_trains_with_muon(ranks):
    for rank in ranks:
        for stage in STAGES:
            ref = rank[f"{stage}/reference"]
            assert ref["ok"] and ref["optimizer"] == "MuonWithAuxAdam", (stage, ref.get("error"))


def test_without_zeroshim(ranks):
    for rank in ranks:
        for stage in STAGES:
            run = rank[f"{stage}/without"]
            if AFFECTED:
                assert not run["ok"] and "You are using an untested ZeRO Optimizer" in run["error"], run
            else:
                ref = rank[f"{stage}/reference"]
                assert run["ok"] and (run["losses"], run["param_sha256"]) == (ref["losses"], ref["param_sha256"])


def test_with_zeroshim_as_the_reference_bit_for_bit(ranks):
    for rank in ranks:
        for stage in STAGES:
            ref = rank[f"{stage}/reference"]
            for arm in ("with", "allowed/with"):
                run = rank[f"{stage}/{arm}"]
                assert run["ok"], (stage, arm, run.get("error"))
                assert (run["losses"], run["param_sha256"]) == (ref["losses"], ref["param_sha256"]), (stage, arm)
        # the check runs once per engine: it says yes where DeepSpeed said no (with and without the key)
        assert rank["stats"] == {"acted": 4 if AFFECTED else 0}, rank["stats"]


def test_status_follows_the_range(ranks):
    state = ranks[0]["status"]
    assert state["state"] == ("applied" if AFFECTED else "skipped"), state


@pytest.mark.parametrize("affected", [True, False])
def test_doctor_names_muon_under_zero_without_the_key(affected):
    """``zeroshim doctor --config``'s check, given the gate's verdict (the boundaries are the tests' above)."""
    from zeroshim import _dsconfig
    from zeroshim.patches.muon_zero_supported import PATCH

    def said(stage, kind="Muon", **extra):
        cfg = {"optimizer": {"type": kind, "params": {"lr": 0.02}}, "zero_optimization": {"stage": stage}, **extra}
        return PATCH.check_config(_dsconfig.read(cfg)[0], affected)

    found = said(2)
    assert [f["level"] for f in found] == (["error"] if affected else [])
    if affected:
        assert "zero_allow_untested_optimizer" in found[0]["message"] and "stage 2" in found[0]["message"]
        assert said(1) and said(2, kind="muon")
    assert not said(2, zero_allow_untested_optimizer=True)
    assert not said(0)  # no ZeRO: no check
    assert not said(3)  # ZeRO-3: DeepSpeed refuses Muon there with its own message
    assert not said(2, kind="AdamW")


IMPORT_ORDER = """
import zeroshim, deepspeed
import deepspeed.runtime.engine as engine, deepspeed.runtime.zero.utils as utils
from zeroshim._patcher import is_patched_by

def state():
    return (is_patched_by(engine.is_zero_supported_optimizer, "muon_zero_supported"),
            is_patched_by(utils.is_zero_supported_optimizer, "muon_zero_supported"))

print(*state())
zeroshim.unpatch("muon_zero_supported")
print(*state(), engine.is_zero_supported_optimizer is utils.is_zero_supported_optimizer)
"""


@pytest.mark.skipif(not AFFECTED, reason="the patch installs nothing on this DeepSpeed")
def test_zeroshim_imported_first_the_engines_name_is_wrapped_and_undone():
    """zeroshim imported first: the engine's ``from ... import is_zero_supported_optimizer`` binds the wrapper;
    undo must put DeepSpeed's function back there too."""
    out = subprocess.run([sys.executable, "-c", IMPORT_ORDER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-3:-1] == ["True True", "False False True"], out.stdout
