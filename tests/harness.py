"""Launch scenario workers under torchrun and collect their per-rank results."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import zeroshim

# The scenarios ship inside the package (zeroshim prove runs them too): the installed copy is tested.
#: The environment of the matrix where what does not depend on the release runs (tests marked
#: ``once``, 1-rank variants; see conftest.py).  Outside nox (``ZSTEST_ENV`` unset) everything runs.
ONCE_ENV = "ds0.19.8"
EVERYTHING_HERE = os.environ.get("ZSTEST_ENV") in (None, ONCE_ENV)

SCENARIOS = Path(zeroshim.__file__).parent / "scenarios"
TIMEOUT = int(os.environ.get("ZSTEST_TIMEOUT", "900"))


def ds_before(version: str) -> bool:
    """True if the installed DeepSpeed is older than ``version`` (pre-releases count as the release)."""
    from zeroshim import _versions

    installed = _versions.installed("deepspeed")
    return installed is not None and _versions.base_version(installed) < _versions.base_version(version)


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


SHM_DIR = Path("/dev/shm")


def remove_shm_buffers(port: int) -> None:
    """Delete the shared-memory all-reduce buffers of the DeepSpeed run that used
    ``port``.  DeepSpeed's CPU comm op creates one per rank
    (``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, 66 MiB on 0.19)
    and never unlinks it (deepspeedai/DeepSpeed#4115): a test session of
    hundreds of launches would fill /dev/shm, and ranks then die of SIGKILL/SIGBUS."""
    for path in SHM_DIR.glob(f"deepspeed_*_{port}_*"):
        try:
            path.unlink()
        except OSError:
            pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def master_port():
    """A free port for one DeepSpeed launch; its /dev/shm buffers are deleted
    when the block ends (see :func:`remove_shm_buffers`)."""
    port = free_port()
    try:
        yield port
    finally:
        remove_shm_buffers(port)


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


def clean_env(**extra: str) -> dict:
    """The test process's environment without zeroshim flags (nor the variable
    ``zeroshim-run`` carries them in), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSHIM_") and k != "PYTHON_ZEROSHIM_ENV"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true")
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(SCENARIOS)]))
    return env


def torchrun(script: str, nproc: int, out_dir: Path, *args: str, env: dict | None = None,
             launcher: list[str] | None = None, check: bool = True) -> dict:
    """Run ``zeroshim/scenarios/<script>`` (the installed copy) on ``nproc`` ranks; return
    ``{"returncode", "log", "ranks": [rank0 results, ...]}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(env or clean_env())
    # DeepSpeed's own launcher sets LOCAL_SIZE; torchrun does not, and without it
    # the CPU accelerator of DeepSpeed <= 0.14 shells out to `numactl` (absent here).
    env.setdefault("LOCAL_SIZE", str(nproc))
    with master_port() as port:
        cmd = list(launcher or []) + [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(SCENARIOS / script), "--out", str(out_dir), *args,
        ]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=TIMEOUT)
    (out_dir / "log.txt").write_text(proc.stdout)
    ranks = []
    for rank in range(nproc):
        path = out_dir / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    if check and (proc.returncode != 0 or None in ranks):
        raise AssertionError(f"{script} on {nproc} rank(s) exited {proc.returncode}; log tail:\n"
                             + proc.stdout[-6000:])
    return {"returncode": proc.returncode, "log": proc.stdout, "ranks": ranks}
