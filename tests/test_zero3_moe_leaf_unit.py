"""zero3_moe_leaf's marking on plain torch modules (no DeepSpeed): all or nothing (issue #47 item 3)."""

import pytest

torch = pytest.importorskip("torch")
from zeroshim.patches import zero3_moe_leaf as z  # noqa: E402


def blocks(n):
    return [torch.nn.Linear(2, 2) for _ in range(n)]


def test_marks_every_block():
    mods = blocks(3)
    z.mark_leaves(mods)
    assert all(m._z3_leaf is True and m._zeroshim_input_grad is not None for m in mods)


def test_a_failure_half_way_leaves_no_block_marked(monkeypatch):
    mods = blocks(3)
    mods[0]._z3_leaf = False  # a value that was there before is put back
    real = torch.nn.Module.register_forward_pre_hook
    calls = []

    def fails_on_the_third(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 3:
            raise RuntimeError("zeroshim bug half-way")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "register_forward_pre_hook", fails_on_the_third)
    with pytest.raises(RuntimeError, match="half-way"):
        z.mark_leaves(mods)
    assert len(calls) == 3
    assert mods[0]._z3_leaf is False and all("_z3_leaf" not in vars(m) for m in mods[1:])
    assert all("_zeroshim_input_grad" not in vars(m) for m in mods)
    assert all(not m._forward_pre_hooks for m in mods)  # the hooks registered before the failure are removed
