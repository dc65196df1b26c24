"""CPU adaptations of DeepSpeed's test *references*, imported in every process of both runs of
tests/dsunit/run.py (plain and zeroshim) by site/sitecustomize.py.  Never imports zeroshim, and
touches no DeepSpeed runtime code: only torch's DDP (which DeepSpeed's engines do not use; the tests
build it as the reference model) and one helper of DeepSpeed's test tree.

DeepSpeed's own CPU CI (.github/workflows/cpu-torch-latest.yml) runs with ``LOCAL_SIZE`` unset, so
the CPU accelerator counts one device per NUMA node (1 on a GitHub runner) and every 2-rank test
skips there; this runner sets ``LOCAL_SIZE=2`` and so reaches 2-rank tests whose reference code was
only ever run on GPUs.  Two GPU assumptions in that reference code, each fixed here for the CPU
accelerator only:

``ddp_device_ids``
    tests/unit/v1/zero/test_zero_user_backward.py (and test_zero_autocast.py) build the DDP
    reference as ``DDP(model, device_ids=[rank], output_device=rank)`` with ``rank =
    get_accelerator().current_device()``.  torch refuses ``device_ids`` for a CPU module ("device_ids
    and output_device arguments only work with single-device/multiple-device GPU modules or CPU
    modules"; for CPU modules torch's documentation says they must be None).  Here: a module whose
    parameters are all on the CPU gets DDP with ``device_ids=None, output_device=None``, which is
    the same data-parallel reference torch builds for CPU modules.

``reduce_flags_device``
    tests/unit/common.py ``reduce_boolean_flags`` (under ``allclose_on_all_ranks``, the tests'
    cross-rank comparison) makes its flag tensors on ``get_accelerator().current_device()``.  On the
    CPU accelerator that is ``os.environ['LOCAL_RANK']``, a string such as ``'0'``, and torch raises
    "Invalid device string: '0'" (an int would mean an accelerator torch does not have either).
    Here: while that helper runs, the accelerator's ``current_device()`` answers its
    ``current_device_name()`` (``'cpu'``), so the flags are made on the CPU.  The helper then
    all-gathers a 0-d flag into a ``(world_size,)`` tensor (``all_gather_into_tensor``); NCCL takes
    that, gloo refuses it ("ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (),
    got (1))"), so while the helper runs its ``dist.all_gather_into_tensor`` gets the flag as a
    1-element tensor (the same values gathered, in the same order).

Each adaptation that acts appends ``{"test", "fix", "pid"}`` to ``$ZS_DSUNIT_HARNESSLOG.<pid>`` (when
set), so the report can say which tests needed which.
"""

import json
import os

_logged = set()


def _record(fix: str) -> None:
    path = os.environ.get("ZS_DSUNIT_HARNESSLOG")
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if not path or (fix, test) in _logged:
        return
    _logged.add((fix, test))
    try:
        with open(f"{path}.{os.getpid()}", "a") as f:
            f.write(json.dumps({"test": test, "fix": fix, "pid": os.getpid()}) + "\n")
    except OSError:
        pass


def _all_on_cpu(module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def _patch_ddp(mod) -> None:
    import wrapt

    def init(wrapped, instance, args, kwargs):
        # DistributedDataParallel(module, device_ids=None, output_device=None, ...)
        module = args[0] if args else kwargs.get("module")
        has_ids = len(args) > 1 or kwargs.get("device_ids") is not None or kwargs.get("output_device") is not None
        if has_ids and module is not None and _all_on_cpu(module):
            args = args[:1]
            kwargs = dict(kwargs, device_ids=None, output_device=None)
            _record("ddp_device_ids")
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(mod, "DistributedDataParallel.__init__", init)


class _GatherFlat:
    """deepspeed.comm, except that all_gather_into_tensor of a 0-d tensor gathers it as shape (1,)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def all_gather_into_tensor(self, output_tensor, tensor, *args, **kwargs):
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        return self._real.all_gather_into_tensor(output_tensor, tensor, *args, **kwargs)


def _patch_common(mod) -> None:
    import wrapt

    def reduce_flags(wrapped, instance, args, kwargs):
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        if acc.device_name() != "cpu":
            return wrapped(*args, **kwargs)
        _record("reduce_flags_device")
        acc.current_device = acc.current_device_name  # instance attribute, for this call only
        real_dist = mod.dist
        mod.dist = _GatherFlat(real_dist)  # unit.common's `deepspeed.comm as dist`, for this call only
        try:
            return wrapped(*args, **kwargs)
        finally:
            mod.dist = real_dist
            del acc.current_device

    if hasattr(mod, "reduce_boolean_flags"):
        wrapt.wrap_function_wrapper(mod, "reduce_boolean_flags", reduce_flags)


def install() -> None:
    if os.environ.get("ZS_DSUNIT_CPU_HARNESS", "1") == "0":
        return
    import wrapt

    wrapt.register_post_import_hook(_patch_ddp, "torch.nn.parallel.distributed")
    wrapt.register_post_import_hook(_patch_common, "unit.common")
