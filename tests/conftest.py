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
    if env is not None and env != ONCE_ENV:
        once = pytest.mark.skip(reason=f"does not depend on the DeepSpeed release: runs once, in {ONCE_ENV}")
        one_rank = pytest.mark.skip(reason=f"the 1-rank variant runs in {ONCE_ENV}; here the 2-rank one, which "
                                           "partitions across ranks, proves the same release")
        for item in items:
            if "once" in item.keywords:
                item.add_marker(once)
            elif "deepspeed" in item.keywords and _one_rank_variant(item):
                item.add_marker(one_rank)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
