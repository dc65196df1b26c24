"""``zeroshim prove``: a real proof end to end, and the command's verdicts."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import clean_env
from zeroshim import _prove

BIN = Path(sys.executable).parent


@pytest.mark.deepspeed
@pytest.mark.once  # the command's machinery; each patch's reproduction runs in every environment in its own tests
def test_prove_one_patch_for_real(tmp_path):
    """nonreentrant_checkpoint applies to every release: its reproduction must
    fail without zeroshim and match the reference with it, on this machine."""
    exe = shutil.which("zeroshim", path=str(BIN))
    out = subprocess.run([exe, "prove", "--patches", "nonreentrant_checkpoint", "--json", "--keep", str(tmp_path)],
                         env=clean_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [row] = [r for r in json.loads(out.stdout)["rows"] if r["patch"] == "nonreentrant_checkpoint"]
    assert row["proven"] is True
    assert "has already been reduced" in row["without"] and "bit for bit" in row["with"]
    assert (tmp_path / "nonreentrant_checkpoint" / "log.txt").exists()


def args(**kw):
    base = {"patches": None, "nproc": 2, "device": "cpu", "keep": None, "json": True}
    base.update(kw)
    return argparse.Namespace(**base)


def test_a_patch_that_does_not_prove_itself_fails_the_command(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(_prove.PROOFS, "zero3_dummy_loss", lambda tmp, nproc, device: ("trained", "trained", False))
    assert _prove.main(args(patches="zero3_dummy_loss", keep=str(tmp_path))) == 1
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["proven"] is False


def test_a_launch_that_cannot_run_is_not_proven(monkeypatch, capsys, tmp_path):
    def broken(tmp, nproc, device):
        raise _prove.Unproven("the launch exited 1")

    monkeypatch.setitem(_prove.PROOFS, "zero3_dummy_loss", broken)
    assert _prove.main(args(patches="zero3_dummy_loss", keep=str(tmp_path))) == 1
    assert "could not run: the launch exited 1" in capsys.readouterr().out


def test_unknown_patch_is_a_usage_error(capsys):
    assert _prove.main(args(patches="no_such_patch")) == 2
    assert "valid:" in capsys.readouterr().err


def test_every_patch_has_a_proof():
    import zeroshim

    assert set(_prove.PROOFS) == set(zeroshim.patch_names())
