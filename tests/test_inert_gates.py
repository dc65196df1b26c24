"""Where a test module's patch is not affected (``AFFECTED`` false) and the module proves its
inert run in one release only (``INERT_ENVS``, tests/conftest.py), the launches are skipped in the
other releases; here, in every release and without a launch, zeroshim's own gate must agree that
the patch is not affected (so it installs nothing), and agree where the module says it is."""

import importlib
import pathlib
import re

import pytest

import zeroshim
from zeroshim import _core

HERE = pathlib.Path(__file__).parent
MODULES = sorted(p.stem for p in HERE.glob("test_*.py") if re.search(r"^INERT_ENVS = ", p.read_text(), re.M))


def test_some_modules_declare_inert_envs():
    assert len(MODULES) >= 5, MODULES


@pytest.mark.parametrize("module", MODULES)
def test_gate_agrees_with_the_module(module):
    mod = importlib.import_module(module)
    affected, reason = _core.gate_verdict(mod.PATCH)
    assert affected == bool(mod.AFFECTED), (module, reason)
    assert mod.PATCH is zeroshim.get_patch(mod.PATCH.name)
