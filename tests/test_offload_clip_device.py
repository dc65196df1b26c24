"""Patch offload_clip_device (patches/offload_clip_device/scenario.py).

CPU (CI): real ZeRO-3 + optimizer/param offload training with clipping firing
every step, with and without zeroshim (on the CPU both must train, bit for
bit the same); and the live optimizer's real ``unscale_and_clip_grads`` called
with the norm on a CUDA device simulated by FakeTensorMode (torch's own device
rules, no GPU): fails without the patch, passes with it.

GPU (``gpu`` marker): the real failure on CUDA; patched parameters after 3
steps equal a no-offload reference within bf16 tolerance."""

import math
import re

import pytest

import zeroshim
from harness import load_proof, matches, message, torchrun
from zeroshim import _prove, _versions

pytestmark = pytest.mark.deepspeed
PATCH = zeroshim.get_patch("offload_clip_device")
DS = _versions.installed("deepspeed")
# written here from the tagged sources (0.14.1 and 0.14.2 keep ZeRO-3's global norm as a device tensor, #5256 in
# 0.14.3), not read from the patch's gate: tests/test_inert_gates.py compares the two
AFFECTED = DS is not None and (_versions.base_version("0.14.1") <= _versions.base_version(DS)
                               < _versions.base_version("0.14.3"))


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    return torchrun("offload_clip_device", 1, tmp_path_factory.mktemp("offload_cpu"))["ranks"][0]


def test_status_follows_the_affected_range(cpu):
    state = cpu["status"]["offload_clip_device"]
    if AFFECTED:
        assert state["state"] == "applied", state
    else:
        assert state["state"] == "skipped" and state["reason"].startswith("not affected"), state


def test_cpu_offload_training_with_clipping_is_unchanged(cpu):
    without, with_ = cpu["without/offload"], cpu["with/offload"]
    assert without["ok"], without.get("error")
    assert with_["ok"], with_.get("error")
    assert min(without["grad_norms"]) > 1e-3  # >> gradient_clipping=1e-6: every step clipped
    assert with_["losses"] == without["losses"]
    assert with_["param_sha256"] == without["param_sha256"]


def test_real_method_with_norm_on_another_device(cpu):
    without, patched = cpu["without/fake_cuda_norm"], cpu["with/fake_cuda_norm"]
    assert cpu["forced_status"]["state"] == "applied"
    assert without["grad_device"] == "cpu"
    if "DataDependentOutputException" in without.get("error", ""):
        pytest.skip(f"deepspeed {DS}'s unscale_and_clip_grads branches on the norm's value (`if clip > 1`), "
                    "which FakeTensor cannot evaluate; the gpu test covers this release")
    # FakeTensor raises from its own frames: the message is the evidence here (the gpu test has the real frames)
    assert not without["ok"] and re.search(message(PATCH.signatures[0]), without["error"]), without
    assert patched["ok"], patched.get("error")
    assert without["real_grad_untouched"] and patched["real_grad_untouched"]


@pytest.mark.gpu
def test_gpu_zero3_offload_clipping(tmp_path):
    out = torchrun("offload_clip_device", 1, tmp_path, "--device", "cuda")["ranks"][0]
    ref, without, with_ = out["reference/no_offload"], out["without/offload"], out["with/offload"]
    assert ref["ok"], ref.get("error")
    if AFFECTED:
        assert not without["ok"] and matches(PATCH.signatures[0], without["error"]), without
    else:
        assert without["ok"], without.get("error")
    assert with_["ok"], with_.get("error")
    assert min(with_["grad_norms"]) > 1e-3
    for a, b in zip(with_["param_values"], ref["param_values"]):
        assert math.isclose(a, b, rel_tol=2 ** -7, abs_tol=1e-3), (a, b)  # bf16 tolerance


def test_proof(cpu):
    """The judge `zeroshim prove` uses (patches/offload_clip_device/proof.py) on this launch.  On CPU its
    form is a simulation (the norm on a simulated CUDA device reaches the real method), which shows the
    mismatch on any release: `prove` runs it only where the gate applies, and so does this test."""
    if not AFFECTED:
        pytest.skip("not affected here: zeroshim prove does not run this proof (the CPU form simulates the device)")
    try:
        without, with_, proven = load_proof("offload_clip_device").judge(cpu)
    except _prove.NotHere as exc:  # as test_real_method_with_norm_on_another_device, and prove says so
        pytest.skip(str(exc))
    assert proven, (without, with_)
