"""Patch numpy2_compat: DeepSpeed < 0.14.4 with numpy 2.

The environment keeps numpy < 2 (its pins); where nox provides numpy 2 in a
side directory (ZSTEST_NUMPY2), DeepSpeed is run with it first on
PYTHONPATH: the import fails without the patch and real ZeRO-2/3 training
works with it."""

import os
import subprocess
import sys

import pytest

import zeroshim
from harness import clean_env, load_proof, matches, torchrun
from zeroshim import _versions

PATCH = zeroshim.get_patch("numpy2_compat")
NUMPY2 = os.environ.get("ZSTEST_NUMPY2")
needs_numpy2 = pytest.mark.skipif(not NUMPY2, reason="no numpy 2 side directory in this environment")
# The launches run DeepSpeed with the side directory's numpy 2, not this process's numpy: the gate for that stack
# (placement in tests/conftest.py), from the installed DeepSpeed and the side directory's presence.
_DS = _versions.installed("deepspeed")
LAUNCH_GATE = (bool(NUMPY2) and _DS is not None and _versions.base_version(_DS) < _versions.base_version("0.14.4"),
               f"numpy 2 from {NUMPY2} with deepspeed {_DS}" if NUMPY2 else "no numpy 2 side directory here")


def test_status_here():
    state = zeroshim.status()["numpy2_compat"]
    numpy1 = _versions.base_version(_versions.installed("numpy")) < _versions.base_version("2")
    ds_new = _versions.base_version(_versions.installed("deepspeed")) >= _versions.base_version("0.14.4")
    if numpy1 or ds_new:
        assert state.state == "skipped" and state.reason.startswith("not affected"), state
    else:
        assert state.state in ("applied", "pending"), state


def python(code, tmp_path, **env):
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=NUMPY2, **env))


@needs_numpy2
def test_import_fails_without_the_patch_and_works_with_it(tmp_path):
    code = "import zeroshim, numpy, deepspeed; print(numpy.__version__, deepspeed.__version__)"
    off = python(code, tmp_path, ZEROSHIM_NUMPY2_COMPAT="off")
    assert off.returncode != 0 and matches(PATCH.signatures[0], off.stderr), off.stderr[-2000:]
    on = python(code + "; print(zeroshim.status()['numpy2_compat'].state)", tmp_path)
    assert on.returncode == 0, on.stderr[-2000:]
    numpy_version, ds_version, state = on.stdout.split()[-3:]
    assert numpy_version.startswith("2.") and state == "applied"


@needs_numpy2
@pytest.mark.deepspeed
def test_real_training_on_numpy2(tmp_path):
    ranks = torchrun("nonreentrant_checkpoint", 1, tmp_path, "--stages", "2,3",
                     env=clean_env(PYTHONPATH=NUMPY2))["ranks"]
    rank = ranks[0]
    assert rank["status"]["numpy2_compat"]["state"] == "applied"
    for stage in (2, 3):
        assert rank[f"reference/z{stage}"]["ok"], rank[f"reference/z{stage}"].get("error")
        assert rank[f"with/z{stage}"]["ok"], rank[f"with/z{stage}"].get("error")
        assert rank[f"with/z{stage}"]["param_sha256"] == rank[f"reference/z{stage}"]["param_sha256"]


@needs_numpy2
@pytest.mark.deepspeed
def test_proof(tmp_path):
    """The scenario and judge `zeroshim prove` uses (patches/numpy2_compat/), with numpy 2 first on the path."""
    ranks = torchrun("numpy2_compat", 1, tmp_path, "--pythonpath", NUMPY2)["ranks"]
    without, with_, proven = load_proof("numpy2_compat").judge(ranks)
    assert proven, (without, with_)
    assert ranks[0]["status"]["state"] == "applied", ranks[0]["status"]
