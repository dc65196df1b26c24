import importlib.util
import os

import pytest

from corekit import registry, target  # noqa: F401  (fixtures of the core's unit tests)
from harness import ONCE_ENV


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _one_rank_variant(item) -> bool:
    """A scenario test parametrized over rank counts (ids ``1rank``/``2ranks``), in its 1-rank form."""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and "1rank" in callspec.id.split("-")


def pytest_collection_modifyitems(config, items):
    env = os.environ.get("ZSTEST_ENV")
    if env is not None:
        once = pytest.mark.skip(reason=f"does not depend on the DeepSpeed release: runs once, in {ONCE_ENV}")
        bench = os.environ.get("ZSTEST_BENCH") == "1"
        for item in items:
            if ("bench" in item.keywords) != bench:
                # the benchmark smokes run in `nox -s bench` (ZSTEST_BENCH=1, which runs nothing else)
                item.add_marker(pytest.mark.skip(reason="benchmark smokes run in `nox -s bench`" if not bench
                                                 else "`nox -s bench` runs the benchmark smokes only"))
            elif "once" in item.keywords and env != ONCE_ENV:
                item.add_marker(once)
            elif "deepspeed" in item.keywords and getattr(item.module, "ENVS", None) and env not in item.module.ENVS:
                # a module that names the releases its launches prove (ENVS, with ENVS_REASON): the others skip them
                item.add_marker(pytest.mark.skip(reason=f"runs in {', '.join(item.module.ENVS)}: "
                                                        f"{item.module.ENVS_REASON}"))
            elif ("deepspeed" in item.keywords and getattr(item.module, "INERT_ENVS", None)
                  and not item.module.AFFECTED and env not in item.module.INERT_ENVS):
                # not affected in this release, so the patch installs nothing here (tests/test_inert_gates.py
                # checks that gate in-process); its launches where the bug is absent (nothing may change) run
                # in INERT_ENVS, and in every release where it is affected
                item.add_marker(pytest.mark.skip(reason=f"not affected in this release: its run where the bug is "
                                                        f"absent is proven in {', '.join(item.module.INERT_ENVS)}, "
                                                        "and the gate here by tests/test_inert_gates.py"))
            elif "deepspeed" in item.keywords and _one_rank_variant(item):
                # a test module whose patch is not affected in ONCE_ENV also names where its 1-rank runs
                # prove it (ONE_RANK_ENVS); the 1-rank variants run in ONCE_ENV in any case
                where = (ONCE_ENV,) + tuple(getattr(item.module, "ONE_RANK_ENVS", ()))
                if env not in where:
                    item.add_marker(pytest.mark.skip(reason=f"the 1-rank variant runs in {', '.join(where)}; here "
                                                            "the 2-rank one, which partitions across ranks, proves "
                                                            "this release"))
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
