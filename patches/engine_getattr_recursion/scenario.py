"""Scenario for patch ``engine_getattr_recursion``: a ZeRO-2 engine over a 4 -> 4 linear layer, 2 ranks, and
attribute lookups on it.

Lookups, each recorded as ``{"ok": True, "value": ...}`` or the error's type and message, without and with zeroshim
(``without/<lookup>``, ``with/<lookup>``), on a fresh engine each time:

* ``submodule``: ``engine.extra`` after ``engine.extra = nn.Linear(2, 2)`` (the value: its ``in_features``);
* ``buffer``: ``engine.extra_buffer`` after ``engine.register_buffer("extra_buffer", ...)`` (its sum);
* ``property``: a property of an engine subclass that raises AttributeError;
* ``module_attr``: ``engine.in_features`` (the wrapped module's attribute: 4 on every release);
* ``missing``: ``engine.no_such_attribute`` (AttributeError on every release);
* ``hasattr``: ``hasattr(engine, "no_such_attribute")`` (False on every release).

A training step before and after each run's lookups checks the engine still trains (losses recorded).
"""

import torch
import torch.nn as nn

from common import begin, ds_config, enable_zeroshim, end, import_deepspeed

deepspeed = import_deepspeed()
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402  (after import_deepspeed)


class Engine(DeepSpeedEngine):
    """An engine subclass whose property raises AttributeError (a typo inside it)."""

    @property
    def broken(self):
        return self.no_such_attribute_inside


def _record(fn) -> dict:
    try:
        return {"ok": True, "value": fn()}
    except RecursionError as exc:
        return {"ok": False, "error": f"RecursionError: {exc}"}
    except AttributeError as exc:
        return {"ok": False, "error": f"AttributeError: {exc}"}


def lookups() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=2**-4),
                                      config=ds_config(2, micro_batch=1, bf16=False))
    engine.__class__ = Engine
    losses = []

    def step():
        loss = engine(torch.ones(1, 4)).sum()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    step()
    engine.extra = nn.Linear(2, 2)
    engine.register_buffer("extra_buffer", torch.ones(3))
    out = {
        "submodule": _record(lambda: engine.extra.in_features),
        "buffer": _record(lambda: float(engine.extra_buffer.sum())),
        "property": _record(lambda: engine.broken),
        "module_attr": _record(lambda: engine.in_features),
        "missing": _record(lambda: engine.no_such_attribute),
        "hasattr": _record(lambda: hasattr(engine, "no_such_attribute")),
    }
    step()
    out["losses"] = losses
    return out


def main():
    out, results = begin()
    results["without"] = lookups()

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["engine_getattr_recursion"].as_dict()
    results["with"] = lookups()
    results["stats"] = dict(zeroshim.stats("engine_getattr_recursion"))
    end(out, results)


if __name__ == "__main__":
    main()
