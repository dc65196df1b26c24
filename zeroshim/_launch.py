"""The one launcher of the reproductions: ``zeroshim prove``, the test suite and
the benchmarks run a patch's scenario (``patches/<name>/scenario*.py``, shipped
as ``zeroshim/patches/<name>/``) on N CPU ranks, started with it as torchrun
starts them on one node (the same environment variables; torchrun's own process,
which imports torch before any rank starts, is left out: :func:`run_ranks`).

Each launch gets a free port, an environment without zeroshim's flags (the
scenario decides itself when zeroshim is active), the scenario helpers
(``zeroshim/scenarios/common.py``) on ``PYTHONPATH``, and the shared-memory
buffers DeepSpeed's CPU comm op leaves behind are deleted afterwards.  Imports
nothing heavy.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time

#: the scenario helpers (``common.py``), put on each rank's PYTHONPATH
HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")


def patches_dir() -> str:
    """Where the patch folders are: ``zeroshim/patches`` once installed, the
    repository's ``patches/`` in a source checkout."""
    from ._core import _patches_package

    return os.path.dirname(os.path.abspath(_patches_package().__file__))


def scenario(target: str) -> str:
    """The script of ``target``: a patch name (its ``scenario.py``),
    ``<patch>/<script>.py`` for another scenario in that patch's folder, or the
    absolute path of a script (e.g. tests/differential/train.py)."""
    if os.path.isabs(target) and os.path.isfile(target):
        return target
    name, _, script = target.partition("/")
    path = os.path.join(patches_dir(), name, script or "scenario.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no scenario {target!r} (looked for {path})")
    return path


#: the wall-time bound of one launch of a scenario that declares none (``LAUNCH_TIMEOUT_S``): ten times the
#: slowest scenario measured on the 2-core CI machine (65 s alone; 300 s was once too short for a 39-to-61 s
#: scenario with four launches sharing the 2 cores), so an unexpected hang costs 10 minutes, not 15
DEFAULT_TIMEOUT_S = 600


def timeout_of(target: str) -> float:
    """How long one launch of scenario ``target`` may run: the ``LAUNCH_TIMEOUT_S = <seconds>`` its script
    declares at module level (read, not imported: the script imports DeepSpeed), else
    :data:`DEFAULT_TIMEOUT_S`.  A hang reproduction declares a bound a little above its own ``--timeout``."""
    import ast

    try:
        with open(scenario(target)) as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, FileNotFoundError):
        return DEFAULT_TIMEOUT_S
    value = module_constant(tree, "LAUNCH_TIMEOUT_S")
    return float(value) if isinstance(value, (int, float)) else DEFAULT_TIMEOUT_S


def module_constant(tree, name: str):
    """The constant a parsed script assigns to ``name`` at module level (``NAME = <literal>``), else None: what a
    scenario declares for its launcher (``LAUNCH_TIMEOUT_S``, ``LAUNCH_FRESH``), read without importing it."""
    import ast

    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)
                and isinstance(node.value, ast.Constant)):
            return node.value.value
    return None


#: the lowest port :func:`free_port` picks
PORTS_FROM = 20000


def ephemeral_ports() -> "tuple[int, int]":
    """The kernel's range of ephemeral ports (``net.ipv4.ip_local_port_range``; Linux's default where unreadable):
    the ports every connecting socket and every ``bind(port 0)`` gets, gloo's pair sockets and the ranks'
    connections to their store included."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(x) for x in fh.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port nothing listens on now, for a launch's store, picked at random *below* the kernel's ephemeral range.
    A port the kernel handed out (``bind(port 0)``) is one it hands out again: between this call and the launch
    binding it, any connection of another launch running beside it (2 pytest-xdist workers) may take it, and the
    launch dies of EADDRINUSE (seen in CI).  Below that range only another :func:`free_port` can pick it: one
    chance in about 12,000 per launch started in that second, and :func:`launch` then retries on a new port."""
    import random

    low, _ = ephemeral_ports()
    rng = random.SystemRandom()
    for _ in range(100 if low > PORTS_FROM + 1000 else 0):
        port = rng.randrange(PORTS_FROM, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # a range too narrow to pick from: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_taken(log: str) -> bool:
    """Whether a launch's output says its store could not bind its port (another process took it between
    :func:`free_port` and the bind): a launch that never started, to be retried on a new port."""
    return "EADDRINUSE" in log or "address already in use" in log.lower()


def remove_shm_buffers(port: int) -> None:
    """Delete the shared-memory all-reduce buffers of the DeepSpeed run that used
    ``port``.  DeepSpeed's CPU comm op creates one per rank
    (``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, 66 MiB on 0.19)
    and never unlinks it (deepspeedai/DeepSpeed#4115): hundreds of launches
    would fill /dev/shm, and ranks then die of SIGKILL/SIGBUS."""
    for path in glob.glob(f"/dev/shm/deepspeed_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def shm_in_use() -> set:
    """Names of the ``/dev/shm/deepspeed_*`` files some live process of this host has mapped (read from
    ``/proc/<pid>/maps``): another DeepSpeed run's buffers."""
    used = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps, errors="replace") as fh:
                used.update(re.findall(r"/dev/shm/(deepspeed_\S+)", fh.read()))
        except OSError:
            continue
    return used


def remove_new_shm_buffers(before: set) -> None:
    """Delete the ``/dev/shm/deepspeed_*`` buffers that appeared since ``before`` (names listed then) and
    that no live process maps: a launch's own leftovers (see :func:`remove_shm_buffers`), never those of a
    run still going beside it (deleting them left that run's ranks waiting for each other's buffer)."""
    if not os.path.isdir("/dev/shm"):
        return
    used = shm_in_use()
    for name in set(os.listdir("/dev/shm")) - set(before):
        if name.startswith("deepspeed_") and name not in used:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


@contextlib.contextmanager
def master_port():
    """A free port for one DeepSpeed launch; its /dev/shm buffers are deleted
    when the block ends."""
    port = free_port()
    try:
        yield port
    finally:
        remove_shm_buffers(port)


def clean_env(device: str = "cpu", **extra: str) -> dict:
    """This process's environment without zeroshim's flags (nor the variable
    ``zeroshim-run`` carries them in), offline, one thread per rank, the
    scenario helpers on PYTHONPATH; plus ``extra``.  For the CPU forms of the
    reproductions (``device="cpu"``) DeepSpeed's CPU accelerator is forced and
    GPUs are hidden: on a GPU machine DeepSpeed would otherwise pick CUDA while
    the scenarios feed CPU tensors over gloo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSHIM_") and k != "PYTHON_ZEROSHIM_ENV"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true")
    if device == "cpu":
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), HELPERS]))
    return env


def device_of(args) -> str:
    """The device a scenario runs on: ``cuda`` where its arguments ask for its GPU form
    (``--device cuda``), else ``cpu``."""
    args = list(args)
    return "cuda" if "--device" in args[:-1] and args[args.index("--device") + 1] == "cuda" else "cpu"


def _descendants(pid: int) -> list:
    """Every process below ``pid`` (read from /proc; [] where there is none)."""
    children: dict = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc) -> None:
    """SIGKILL a launcher, its process group and every process below it.  torchrun starts its ranks in
    sessions of their own, so the group alone does not reach them; they are found before the launcher
    dies (after that they belong to init)."""
    import signal

    for pid in [proc.pid] + _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_group(cmd: list, *, env: "dict | None" = None, timeout: float, cwd: "str | None" = None,
              merge: bool = False) -> "tuple":
    """Run ``cmd`` (a launcher and its ranks) in a process group of its own; ``(returncode, stdout,
    stderr)``, stderr merged into stdout with ``merge``.  Past ``timeout`` the launcher and every
    process below it are killed (ranks left behind in a collective would spin on the CPU for good,
    and hold the output pipes open) and the return code is -1, with what had been printed."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        code = -1
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # something out of reach still holds the pipes: give up on them
            out, err = "", ""
    finally:
        if proc.poll() is None:  # an interrupt (KeyboardInterrupt) while waiting: take the ranks down too
            _kill_tree(proc)
            proc.wait()
    return code, out or "", err or ""


def rank_env(env: dict, rank: int, nproc: int, port: int) -> dict:
    """What torchrun (``torch.distributed.run``, one node, no restarts) puts in worker ``rank``'s
    environment, on top of ``env``.  The ranks' own c10d store is hosted by rank 0 (env:// as in
    ``torch.distributed.init_process_group`` without torchrun's agent store)."""
    out = dict(env)
    out.update(LOCAL_RANK=str(rank), RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
               LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
               TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="False",
               TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def _env_of(env: dict, rank: int, nproc: int, port: int, rank_envs: "dict | None") -> dict:
    """Rank ``rank``'s whole environment: :func:`rank_env`, then what ``rank_envs`` exports on that rank only."""
    out = rank_env(env, rank, nproc, port)
    out.update((rank_envs or {}).get(rank) or {})
    return out


#: after one rank fails, how long the others get to end on their own before they are killed (torchrun's agent
#: stops the other workers at once too; a rank waiting in a collective for a dead peer never ends)
STOP_GRACE_S = 5.0


def run_ranks(cmd: list, nproc: int, port: int, *, env: dict, timeout: float, log_path: str,
              rank_envs: "dict | None" = None) -> "tuple":
    """Start ``nproc`` ranks of ``cmd`` as torchrun does on one node (:func:`rank_env`; each in a session of its
    own), all writing to ``log_path``, without torchrun's own process: its import of torch and its agent cost
    about 3.3 s of wall and CPU time before the ranks start (measured on the 2-core CI machine).  As torchrun's
    agent, when a rank fails the others are stopped, and the launch exits 1; all ranks exiting 0 is 0; past
    ``timeout`` every rank and its children are killed and the code is -1.  ``rank_envs``: as :func:`launch`.
    ``(returncode, log)``."""
    procs = []
    with open(log_path, "w") as log:
        try:
            for rank in range(nproc):
                procs.append(subprocess.Popen(cmd, env=_env_of(env, rank, nproc, port, rank_envs), stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
            code = supervise(procs, timeout, log)
        finally:
            for p in procs:  # an interrupt while waiting: take the ranks down too
                if p.poll() is None:
                    _kill_tree(p)
                    p.wait()
    with open(log_path, errors="replace") as fh:
        return code, fh.read()


def supervise(procs: list, timeout: float, log) -> int:
    """Wait for the ranks ``procs`` (``subprocess.Popen`` or :class:`_Forked`: ``pid``, ``poll()``, ``wait()``) as
    torchrun's agent does: when one fails the others are stopped (SIGTERM, then killed after
    :data:`STOP_GRACE_S`) and the code is 1; all exiting 0 is 0; past ``timeout`` every rank and its children are
    killed and the code is -1.  ``log``: a file the stop is written to."""
    import signal

    deadline, failed_at, code = time.monotonic() + timeout, None, 0
    while True:
        codes = [p.poll() for p in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at, code = time.monotonic(), 1
            log.write(f"[launch] rank {bad[0][0]} exited {bad[0][1]}; stopping the other ranks\n")
            log.flush()
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGTERM)
                    except (ProcessLookupError, PermissionError):
                        pass
        if None not in codes:
            return code
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + STOP_GRACE_S):
            code = -1 if now > deadline else code
            for p in procs:
                if p.poll() is None:
                    _kill_tree(p)
            for p in procs:
                p.wait()
            return code
        time.sleep(0.05)


def launch(target: str, nproc: int, out: str, *args: str, env: "dict | None" = None,
           launcher: "list | None" = None, timeout: float = 900, rank_envs: "dict | None" = None) -> dict:
    """Run scenario ``target`` (see :func:`scenario`) on ``nproc`` ranks with
    ``--out out`` and ``args``; returns ``{"returncode", "log", "ranks"}`` where
    ``ranks[r]`` is what rank r wrote to ``out/rank<r>.json`` (None if nothing).
    A launch that runs past ``timeout`` returns code -1 with what it printed.
    The output is also kept in ``out/log.txt``.  ``rank_envs``: ``{rank: {name:
    value}}``, variables exported on that rank only, on top of ``env`` (a flag set
    on one node only); not with a ``launcher`` or under torchrun, whose ranks all
    get one environment (``ValueError``)."""
    env = dict(env if env is not None else clean_env(device_of(args)))
    rank_envs = _check_rank_envs(rank_envs, nproc, launcher is not None or bool(env.get("ZSLAUNCH_TORCHRUN")))
    os.makedirs(out, exist_ok=True)
    # DeepSpeed's own launcher sets LOCAL_SIZE; torchrun does not, and without it
    # the CPU accelerator of DeepSpeed <= 0.14 shells out to `numactl` (absent here).
    env.setdefault("LOCAL_SIZE", str(nproc))
    started = time.time()
    server = _prefork_server(target, nproc, env, args, launcher, out, rank_envs)
    for attempt in (1, 2):  # a second time, fresh, where another process took the port before the store bound it
        with master_port() as port:
            if server is not None and attempt == 1:
                code, log = _forked_launch(server, target, nproc, port, env, args, out, timeout, rank_envs)
            elif launcher is None and not env.get("ZSLAUNCH_TORCHRUN"):
                code, log = run_ranks([sys.executable, "-u", scenario(target), "--out", out, *args], nproc, port,
                                      env=env, timeout=timeout, log_path=os.path.join(out, "log.txt"),
                                      rank_envs=rank_envs)
            else:  # under torchrun itself (a wrapping launcher, or ZSLAUNCH_TORCHRUN=1 in the environment)
                cmd = list(launcher or []) + [
                    sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                    "--master_addr", "127.0.0.1", "--master_port", str(port), scenario(target), "--out", out, *args]
                code, log, _ = run_group(cmd, env=env, timeout=timeout, merge=True)
                with open(os.path.join(out, "log.txt"), "w") as fh:
                    fh.write(log)
        if code == 0 or not port_taken(log) or any(
                os.path.exists(os.path.join(out, f"rank{r}.json")) for r in range(nproc)):
            break
    wall = time.time() - started
    ranks, ready = [], []
    for rank in range(nproc):
        path = os.path.join(out, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as fh:
                ranks.append(json.load(fh))
        else:
            ranks.append(None)
        try:
            with open(os.path.join(out, f"timing{rank}.json")) as fh:
                ready.append(json.load(fh)["ready"])
        except (OSError, ValueError, KeyError):
            pass
    ready = [t for t in ready if isinstance(t, (int, float))]
    # start-up: from the launch to the last rank done importing torch and DeepSpeed (None where unknown)
    timing = {"wall": round(wall, 2), "startup": round(max(ready) - started, 2) if ready else None,
              "forked": server is not None and attempt == 1}
    return {"returncode": code, "log": log, "ranks": ranks, "timing": timing}


def _check_rank_envs(rank_envs: "dict | None", nproc: int, torchrun: bool) -> dict:
    """``rank_envs`` as :func:`launch` uses it (a copy, empty ones dropped), or ``ValueError``: a rank that is not
    an int of the launch, a name or value that is not a string, a variable :func:`rank_env` sets, or a launch under
    torchrun."""
    out, owned = {}, set(rank_env({}, 0, 1, 0))
    for rank, variables in (rank_envs or {}).items():
        if not isinstance(rank, int) or not 0 <= rank < nproc:
            raise ValueError(f"rank_envs: rank {rank!r} is not one of the launch's ranks 0..{nproc - 1}")
        for name, value in (variables or {}).items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise ValueError(f"rank_envs[{rank}]: {name!r}={value!r}: names and values must be strings")
            if name in owned:
                raise ValueError(f"rank_envs[{rank}]: {name} is set by the launcher for every rank")
        if variables:
            out[rank] = dict(variables)
    if out and torchrun:
        raise ValueError("rank_envs: torchrun gives every rank one environment; launch without a launcher "
                         "and without ZSLAUNCH_TORCHRUN")
    return out


def _prefork_server(target: str, nproc: int, env: dict, args, launcher, out: str, rank_envs: "dict | None" = None):
    """The pre-fork server this launch's ranks are forked from (``zeroshim/_prefork.py``), or None: pre-forked
    launches are off, the caller chose the launcher or an environment (a rank's own included) that differs from
    the standard one in more than zeroshim's flags, or in a flag that changed what the server's import of zeroshim
    did (:func:`zeroshim._prefork.import_flags`), the scenario must start fresh, or the server could not start
    (said in the launch's folder, ``out/prefork.txt``)."""
    from . import _prefork

    if not _prefork.enabled() or launcher is not None or env.get("ZSLAUNCH_TORCHRUN"):
        return None
    standard = clean_env(device_of(args))
    standard.setdefault("LOCAL_SIZE", str(nproc))
    envs = [{**env, **(rank_envs or {}).get(rank, {})} for rank in range(nproc)]
    differ = sorted({k for e in envs for k in set(e) | set(standard)
                     if e.get(k) != standard.get(k) and k not in _prefork.VOLATILE})
    if any(not k.startswith("ZEROSHIM_") for k in differ):
        why = f"its environment is not the standard one ({', '.join(differ[:6])})"
    else:
        why = _prefork.fork_refusal(scenario(target), list(args))
    server = None if why else _prefork.server_for(standard, os.path.dirname(os.path.abspath(out)))
    if server is not None and not server.alive():
        why, server = f"its pre-fork server is not in use: {server.why_not}", None
    elif server is not None and "zeroshim" in server.imported:
        # DeepSpeed < 0.14.4 imports only with zeroshim's import-compat patches: the server's import applied them
        # as its own environment said
        flags = sorted(set(differ) & _prefork.import_flags(server.zeroshim_on))
        if flags:
            why, server = (f"zeroshim flags that change what its server's import of zeroshim did ({', '.join(flags)})",
                           None)
    if why:
        with open(os.path.join(out, "prefork.txt"), "w") as fh:
            fh.write(f"fresh interpreters: {why}\n")
    return server


def _forked_launch(server, target: str, nproc: int, port: int, env: dict, args, out: str, timeout: float,
                   rank_envs: "dict | None" = None):
    """Run the launch's ranks forked from ``server``; ``(returncode, log)`` as :func:`run_ranks`."""
    from . import _prefork

    log_path = os.path.join(out, "log.txt")
    open(log_path, "w").close()
    envs = [{**_env_of(env, rank, nproc, port, rank_envs), _prefork.FORKED: "1"} for rank in range(nproc)]
    code = server.launch(scenario(target), ["--out", out, *args], envs, log_path, timeout)
    if code is None:  # the server failed (not the launch): say so, as a failed launch
        code = 1
        with open(log_path, "a") as fh:
            fh.write(f"[launch] the pre-fork server failed: {server.why_not}\n")
    with open(log_path, errors="replace") as fh:
        return code, fh.read()
