"""Patch torch_elastic_compat: old DeepSpeed imports on current torch.

Real imports in fresh interpreters.  Where the installed DeepSpeed is affected
(< 0.14.4 on a torch without the names), ``import deepspeed`` must fail without
zeroshim and work with it; elsewhere it works without zeroshim and the patch
reports itself skipped.  Real ZeRO-2/3 training on such a DeepSpeed is covered
by the other scenarios, which import DeepSpeed through this patch there."""

import re
import subprocess
import sys

import pytest

import zeroshim
from harness import load_proof, torchrun
from zeroshim import _versions

pytest.importorskip("torch")
PATCH = zeroshim.get_patch("torch_elastic_compat")
DS = _versions.installed("deepspeed")


def python(code, tmp_path, **env):
    base = {"PATH": "/usr/bin:/bin", **env}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=base, capture_output=True, text=True)


def torch_lacks_names():
    """Asked of a fresh interpreter: in this one zeroshim may have added them."""
    code = "import torch.distributed.elastic.agent.server.api as a; print(hasattr(a, '_get_socket_with_port'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "False"


AFFECTED = DS is not None and _versions.base_version(DS) < _versions.base_version("0.14.4") and torch_lacks_names()


def test_import_deepspeed_without_zeroshim(tmp_path):
    out = python("import deepspeed", tmp_path)
    if AFFECTED:
        assert out.returncode != 0
        assert re.search(PATCH.signatures[0], out.stderr), out.stderr[-2000:]
    else:
        assert out.returncode == 0, out.stderr[-2000:]


def test_import_deepspeed_with_zeroshim(tmp_path):
    code = ("import zeroshim, deepspeed; s = zeroshim.status()['torch_elastic_compat']; "
            "print(deepspeed.__version__, '|', s.state, '|', s.reason)")
    out = python(code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    last_line = out.stdout.strip().splitlines()[-1]  # DeepSpeed prints to stdout too
    version, state, reason = (x.strip() for x in last_line.split("|"))
    assert version == DS
    if AFFECTED:
        assert state == "applied"
    else:
        assert state == "skipped" and reason.startswith("not affected"), reason


def test_flag_off_brings_the_failure_back(tmp_path):
    out = python("import zeroshim, deepspeed", tmp_path, ZEROSHIM_TORCH_ELASTIC_COMPAT="off")
    assert (out.returncode != 0) == AFFECTED


@pytest.mark.skipif(not AFFECTED, reason=f"DeepSpeed {DS} on this torch is not affected (nothing is added)")
def test_added_names_work_and_undo_removes_them():
    import torch.distributed.elastic.agent.server.api as api

    assert zeroshim.is_applied("torch_elastic_compat")
    sock = api._get_socket_with_port()
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()
    # only what this DeepSpeed imports: `log` is imported by DeepSpeed < 0.14.1 alone
    assert hasattr(api, "log") == (_versions.base_version(DS) < _versions.base_version("0.14.1"))
    zeroshim.unpatch("torch_elastic_compat")
    try:
        assert not hasattr(api, "_get_socket_with_port")
    finally:
        zeroshim.apply("torch_elastic_compat")
    assert hasattr(api, "_get_socket_with_port")


@pytest.mark.skipif(AFFECTED, reason=f"DeepSpeed {DS} on this torch is affected (see the test above)")
def test_not_affected_here_reports_skipped():
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (the target is imported)

    status = zeroshim.status()["torch_elastic_compat"]
    assert status.state == "skipped" and status.reason.startswith("not affected"), status


@pytest.mark.parametrize("version,names", [("0.13.5", ["log", "_get_socket_with_port"]),
                                           ("0.14.0", ["log", "_get_socket_with_port"]),
                                           ("0.14.1", ["_get_socket_with_port"]),
                                           ("0.14.3", ["_get_socket_with_port"]),
                                           ("0.14.4", [])])
def test_each_name_has_its_own_range(monkeypatch, version, names):
    from zeroshim.patches import torch_elastic_compat as patch

    monkeypatch.setattr(patch._versions, "installed", lambda package: version)
    assert patch.needed_names() == names


def test_fallback_socket_helper():
    from zeroshim.patches.torch_elastic_compat import _socket_with_free_port

    sock = _socket_with_free_port()
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


@pytest.mark.deepspeed
def test_proof(tmp_path):
    """The scenario and judge `zeroshim prove` uses (patches/torch_elastic_compat/): ``import deepspeed``
    fails without zeroshim with this patch's own error where affected, and imports with it."""
    ranks = torchrun("torch_elastic_compat", 1, tmp_path)["ranks"]
    without, with_, proven = load_proof("torch_elastic_compat").judge(ranks)
    assert proven == AFFECTED, (without, with_)
    assert ranks[0]["with"]["ok"], ranks[0]["with"].get("error")
    assert ranks[0]["status"]["state"] == ("applied" if AFFECTED else "skipped"), ranks[0]["status"]
