"""Launch scenario workers under torchrun and collect their per-rank results."""

from __future__ import annotations

import json
import os
from pathlib import Path

from zeroshim import _launch
from zeroshim._prove import ABORT_AT_EXIT

# The scenarios ship inside the package, in each patch's folder (zeroshim prove runs them too): the
# installed copy is tested.
#: The environment of the matrix where what does not depend on the release runs (tests marked
#: ``once``, 1-rank variants; see conftest.py).  Outside nox (``ZSTEST_ENV`` unset) everything runs.
ONCE_ENV = "ds0.19.8"
#: The newest DeepSpeed, transformers and torch of the matrix: every patch's launches run there (tests/conftest.py
#: ``placement``), beside the environments where its gate says affected.
NEWEST_ENV = ONCE_ENV
EVERYTHING_HERE = os.environ.get("ZSTEST_ENV") in (None, ONCE_ENV)

#: every launch's wall-time bound where set; else each scenario's own (``_launch.timeout_of``)
TIMEOUT = int(os.environ["ZSTEST_TIMEOUT"]) if os.environ.get("ZSTEST_TIMEOUT") else None


def before(package: str, version: str) -> bool:
    """True if the installed ``package`` is older than ``version`` (pre-releases count as the release); False
    where it is not installed."""
    from zeroshim import _versions

    installed = _versions.installed(package)
    return installed is not None and _versions.base_version(installed) < _versions.base_version(version)


def ds_before(version: str) -> bool:
    """True if the installed DeepSpeed is older than ``version`` (pre-releases count as the release)."""
    return before("deepspeed", version)


def peft_between(low: str, high: str) -> bool:
    """True if the installed peft is in [low, high) (pre-releases count as the release)."""
    from zeroshim import _versions

    installed = _versions.installed("peft")
    return installed is not None and \
        _versions.base_version(low) <= _versions.base_version(installed) < _versions.base_version(high)


def matches(signature, text: str) -> bool:
    """Does ``text`` show a patch's error signature: a regex, or a tuple of
    regexes that must all be found (the message and what makes it that bug)?"""
    import re

    patterns = (signature,) if isinstance(signature, str) else tuple(signature)
    return all(re.search(pattern, text) for pattern in patterns)


def message(signature) -> str:
    """A signature's message pattern alone, for an error recorded without its
    traceback (the supporting evidence a signature may ask for is in whole logs)."""
    return signature if isinstance(signature, str) else signature[0]


# One launcher for the tests, `zeroshim prove` and the benchmarks (zeroshim/_launch.py).
free_port, master_port, remove_shm_buffers = _launch.free_port, _launch.master_port, _launch.remove_shm_buffers


def _portable_isa() -> dict:
    """Environment that makes torch's CPU kernels (ATen's vectorised code and oneDNN) use AVX2
    where the CPU has it, so numbers recorded on one x86 machine reproduce bit for bit on
    another.  Left to themselves they pick the widest ISA: on a CPU with AVX-512 + bf16 the
    lora_recompute losses differ from an AVX2 machine's in the last float32 bit (4.0692400 vs
    4.0692396), with or without zeroshim.  Empty where there is no AVX2 (not x86, or too old)."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return {}
    if "avx2" not in flags or "fma" not in flags:
        return {}
    return {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


#: For runs compared with numbers recorded on another machine (tests/fixtures/).
PORTABLE_ISA = _portable_isa()


def clean_env(device: str = "cpu", **extra: str) -> dict:
    """The test process's environment without zeroshim flags (nor the variable
    ``zeroshim-run`` carries them in), the scenario helpers on PYTHONPATH, DeepSpeed's CPU
    accelerator forced for CPU runs (``zeroshim/_launch.py``), plus ``extra``."""
    return _launch.clean_env(device, **extra)


def load_proof(name: str, record: bool = True):
    """Patch ``name``'s judge (``patches/<name>/proof.py``), the one ``zeroshim prove`` uses.  With
    ``record``, each verdict its ``judge()`` gives on a real launch is also written to ``ZSTEST_PROOF_LOG``
    (noxfile.py sets it per environment; .ci/timings.py fails CI where a patch's proof passed nowhere).
    ``record=False`` for judges fed made-up results (tests/test_prove.py)."""
    from importlib import import_module

    module = import_module(f"zeroshim.patches.{name}.proof")
    return _RecordedProof(module, name) if record else module


class _RecordedProof:
    """A patch's proof module whose ``judge()`` verdicts are logged (see :func:`load_proof`)."""

    def __init__(self, module, name: str):
        self._module, self._name = module, name

    def __getattr__(self, attr):
        return getattr(self._module, attr)

    def judge(self, *args, **kwargs):
        verdict = self._module.judge(*args, **kwargs)
        path = os.environ.get("ZSTEST_PROOF_LOG")
        if path and isinstance(verdict, tuple) and len(verdict) == 3:
            record = {"env": os.environ.get("ZSTEST_ENV"), "patch": self._name, "proven": bool(verdict[2]),
                      "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                      "without": str(verdict[0])[:160], "with": str(verdict[1])[:160]}
            _append(path, record)
        return verdict


def _append(path: str, record: dict) -> None:
    """One JSON line (pytest-xdist workers append to the same file: one short write each)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def log_launch(target: str, nproc: int, args, result: dict) -> None:
    """One line per launch in ``ZSTEST_LAUNCH_LOG`` (JSON lines; noxfile.py sets it per environment, .ci/run
    sums it up): the test, the scenario, its wall time and its start-up time (until every rank had
    imported torch and DeepSpeed; None where the scenario does not say)."""
    path = os.environ.get("ZSTEST_LAUNCH_LOG")
    if not path:
        return
    record = {"env": os.environ.get("ZSTEST_ENV"), "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
              "target": target, "nproc": nproc, "args": [str(a) for a in args][:8],
              "returncode": result.get("returncode"), **result.get("timing", {})}
    _append(path, record)


def torchrun(target: str, nproc: int, out_dir: Path, *args: str, env: dict | None = None,
             launcher: list[str] | None = None, check: bool = True, rank_envs: dict | None = None) -> dict:
    """Run scenario ``target`` -- a patch name (``patches/<name>/scenario.py``) or
    ``<patch>/<script>.py`` -- from the installed copy, on ``nproc`` ranks; return
    ``{"returncode", "log", "ranks": [rank0 results, ...]}``.  ``rank_envs``: ``{rank: {name: value}}``
    exported on that rank only (``zeroshim._launch.launch``)."""
    timeout = TIMEOUT or _launch.timeout_of(target)
    result = _launch.launch(target, nproc, str(out_dir), *args, env=env, launcher=launcher, timeout=timeout,
                            rank_envs=rank_envs)
    log_launch(target, nproc, args, result)
    if result["returncode"] == -1:
        raise AssertionError(f"{target} on {nproc} rank(s) ran past its {timeout:.0f} s bound (_launch.timeout_of) "
                             "and was killed; log tail:\n" + result["log"][-6000:])
    # Every rank wrote its results (the scenario's last step) and a rank then aborted at interpreter exit
    # ("terminate called without an active exception", issue #31 item 8; with and without zeroshim): judged
    # by the results, as `zeroshim prove` does, and said in the test output.
    result["aborted_at_exit"] = (result["returncode"] != 0 and None not in result["ranks"]
                                 and ABORT_AT_EXIT in result["log"])
    if result["aborted_at_exit"]:
        import warnings

        warnings.warn(f"{target} on {nproc} rank(s): every rank wrote its results, then the launch exited "
                      f"{result['returncode']} ({ABORT_AT_EXIT}); judged by the results", stacklevel=2)
    elif check and (result["returncode"] != 0 or None in result["ranks"]):
        raise AssertionError(f"{target} on {nproc} rank(s) exited {result['returncode']}; log tail:\n"
                             + result["log"][-6000:])
    return result
