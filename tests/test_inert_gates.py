"""Where a patch's launches run follows zeroshim's own gate (tests/conftest.py ``placement``: where it says
affected, and in the newest environment), so a gate wrong in some release would silently move that release's
launches.  Here, in every environment and without a launch, the gate must agree with the range each test
module writes itself from the tagged sources (``AFFECTED``; ``APPLIES`` where ``AFFECTED`` names only the
part its main scenario shows).  Modules whose ``AFFECTED`` is read from the gate itself are left out: that
comparison could not fail."""

import importlib
import pathlib
import re

import pytest

import zeroshim
from conftest import patch_of
from zeroshim import _core

HERE = pathlib.Path(__file__).parent


def _independent(path: pathlib.Path) -> bool:
    text = path.read_text()
    line = re.search(r"^(APPLIES|AFFECTED)\b.*=(.*)$", text, re.M)
    return bool(line) and "gate_verdict" not in line.group(0)


MODULES = sorted(p.stem for p in HERE.glob("test_*.py") if _independent(p))


def test_most_patches_have_an_independent_range():
    assert len(MODULES) >= 12, MODULES


@pytest.mark.parametrize("module", MODULES)
def test_gate_agrees_with_the_module(module):
    mod = importlib.import_module(module)
    name = patch_of(module, _core.patch_names())
    assert name is not None, f"{module} proves no registered patch"
    patch = zeroshim.get_patch(name)
    expected = mod.APPLIES if hasattr(mod, "APPLIES") else mod.AFFECTED
    affected, reason = _core.gate_verdict(patch)
    assert affected == bool(expected), (module, reason)
