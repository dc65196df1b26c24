"""Scenario for patch ``stale_build_lock``: DeepSpeed JIT-builds its CPU comm op
(``ShareMemCommBuilder``, what ``deepspeed.init_distributed`` builds on a CPU; on DeepSpeed 0.14,
which has none, the CPU fused Adam) on every rank into a
build folder where a killed build left torch's lock: the file ``<folder>/lock``, created an hour
ago, that no process holds.  Each run has a folder of its own under ``--out`` (shared by the ranks,
as ``~/.cache/torch_extensions`` is on one node); rank 0 leaves the lock there, then every rank
calls DeepSpeed's ``OpBuilder.jit_load()`` (the build ``load()`` does when the op is not prebuilt).

Two launches (``--mode``), as an op loads once per process (torch refuses a second registration of
the comm op's operator library; 0.14's fused Adam, a plain extension module, keeps the same shape);
the process group is gloo's own, without DeepSpeed's comm backend (which would load the comm op at
once).  Runs (per rank):

* ``stale`` launch, ``without``: no zeroshim: still waiting after ``--hang`` seconds, inside
  torch's ``FileBaton.wait`` (the build is left waiting in a daemon thread).  Where the bug is absent
  (torch >= 2.14: an ``flock`` that died with its holder) it builds past the lock at once, and the
  launch ends there (the op is loaded; the ``with`` run is recorded as not run);
* ``stale`` launch, ``with``: zeroshim, a folder of its own: the stale lock is removed once (by
  one rank), the op is built and loads on every rank (``--built-from``: the folder holds a
  finished build under the lock, so the rebuild only checks the objects);
* ``held`` launch (after ``stale``, with the same ``--extensions``): zeroshim; a live process holds the
  lock, dated an hour back (a long build): waited on, never removed; the op loads after.  The
  holder is a process that holds the lock open for ``HOLD_S`` seconds over the ``stale`` launch's
  built folder (``--holder process``, what the tests run), or a real build of the op without
  zeroshim into a folder of its own (``--holder build``, some 40 s longer).
"""

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from common import describe, enable_zeroshim, end, import_deepspeed, versions

#: ranks start as fresh interpreters, never forked from a pre-fork server (zeroshim/_prefork.py): what is proven
#: here is a process's first build of the op under a lock left in its folder
LAUNCH_FRESH = "a build lock: each rank's first build of the op, in a process of its own"

import_deepspeed()

def _op() -> str:
    """The op to build: the CPU comm op (DeepSpeed 0.15+); where the CPU accelerator has none (0.14:
    ``NotImplementedBuilder``, a build without sources), its fused Adam, another JIT-built op."""
    from deepspeed.accelerator import get_accelerator

    for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
        if type(get_accelerator().create_op_builder(name)).__name__ != "NotImplementedBuilder":
            return name
    raise RuntimeError("this DeepSpeed's CPU accelerator JIT-builds neither its comm op nor its fused Adam")


OP = _op()


def builder():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(OP)


def leave_lock(root: str, built: "str | None" = None) -> None:
    """The lock of the op's build folder under ``root`` as a killed build leaves it: a file nobody
    holds, created an hour ago.  ``built``: a folder where the op is built, copied there first (the
    rebuild then finds every object up to date; without it, it compiles them all)."""
    folder = os.path.join(root, builder().name)  # torch builds into TORCH_EXTENSIONS_DIR/<name>
    if built:
        shutil.copytree(built, folder, ignore=shutil.ignore_patterns("lock", "lock.*"))
    os.makedirs(folder, exist_ok=True)
    lock = os.path.join(folder, "lock")
    open(lock, "w").close()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))


def frames(thread) -> list:
    """The innermost function names of ``thread``'s stack, innermost first (``name (file)``)."""
    frame = sys._current_frames().get(thread.ident)
    names = []
    while frame is not None and len(names) < 6:
        names.append(f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)})")
        frame = frame.f_back
    return names


def build(root: str, limit: float) -> dict:
    """DeepSpeed's JIT build of the op into ``root``, in a daemon thread given ``limit`` seconds."""
    os.environ["TORCH_EXTENSIONS_DIR"] = root  # torch reads it at each build
    outcome = {}

    def run():
        try:
            module = builder().jit_load(verbose=False)
            outcome.update(ok=True, loaded=sorted(n for n in dir(module) if not n.startswith("_"))[:3])
        except BaseException as exc:  # noqa: BLE001 (recorded)
            outcome.update(ok=False, error=describe(exc))

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        return {"ok": False, "hang": True, "waited": round(time.monotonic() - start, 1), "stack": frames(thread)}
    outcome.update(hang=False, seconds=round(time.monotonic() - start, 1))
    return outcome


def held(folder_root: str, how: str):
    """A live process holding the lock of the op's folder under ``folder_root``, dated an hour back (a
    long build): ``how`` = "build", a real build of the op without zeroshim (a rank of another job on this
    host, say); "process", a process that holds the lock open for ``HOLD_S`` seconds and then removes it,
    as a build does, over a folder where the op is built (the ``stale`` launch's)."""
    folder = os.path.join(folder_root, builder().name)
    lock = os.path.join(folder, "lock")
    if how == "build":
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=folder_root, ZEROSHIM_DISABLED="1")
        child = subprocess.Popen([sys.executable, "-c", BUILD], env=env)
    else:
        child = subprocess.Popen([sys.executable, "-c", HOLD, lock, str(HOLD_S)])
    while not os.path.exists(lock):
        if child.poll() is not None:
            raise RuntimeError(f"the holder exited ({child.returncode}) before taking the lock")
        time.sleep(0.01)
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    return child


HOLD_S = 5.0
BUILD = ("from deepspeed.accelerator import get_accelerator\n"
         f"get_accelerator().create_op_builder({OP!r}).jit_load(verbose=False)\n")
HOLD = ("import os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\n"
        "time.sleep(float(sys.argv[2]))\n"
        "os.close(fd)\n"
        "os.remove(sys.argv[1])\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["stale", "held"], required=True,
                        help="stale: without zeroshim, then with it; held: with zeroshim, a build in progress")
    parser.add_argument("--extensions", help="the folder of the runs' build folders (default: <out>/extensions); "
                                             "the held launch with --holder process needs the stale launch's")
    parser.add_argument("--built-from", help="stale: a folder where the op is built (the environment's), copied "
                                             "under the lock of the run with zeroshim, so that its rebuild finds "
                                             "the objects up to date (default: an empty folder, a full build)")
    parser.add_argument("--holder", choices=["process", "build"], default="process",
                        help="held: what holds the lock (see held())")
    parser.add_argument("--hang", type=float, default=15, help="seconds after which the run without zeroshim "
                                                                 "counts as hung")
    args = parser.parse_args()
    # a process group without DeepSpeed's comm backend, which would load the comm op now (it loads once per
    # process: torch refuses a second registration of its operator library)
    dist.init_process_group("gloo")
    rank, results = dist.get_rank(), {"versions": versions(), "op": OP}
    out = os.path.abspath(args.out)
    extensions = os.path.abspath(args.extensions or os.path.join(out, "extensions"))
    root = {run: os.path.join(extensions, run) for run in ("without", "with", "held")}

    if args.mode == "stale":
        if rank == 0:
            leave_lock(root["without"], built=args.built_from)
        dist.barrier()
        results["without"] = build(root["without"], args.hang)
        dist.barrier()
        if not results["without"]["hang"]:
            # the bug is absent (torch >= 2.14 locks with flock, which a dead holder does not keep): the op is
            # loaded in this process already, and a second load is refused ("registerLibrary"), so the run
            # with zeroshim has nothing to show
            zeroshim = enable_zeroshim()
            results["status"] = zeroshim.status()["stale_build_lock"].as_dict()
            results["with"] = {"ok": None, "not_run": "the build without zeroshim went past the stale lock"}
            end(out, results)
            return
        # the next build as in a process of its own: torch numbers the builds of one name within a process
        # (deepspeed_shm_comm_v1 or fused_adam_v1 for a second folder), and the held launch loads this folder's build
        from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

        JIT_EXTENSION_VERSIONER.entries.pop(builder().name, None)
        zeroshim = enable_zeroshim()
        results["status"] = zeroshim.status()["stale_build_lock"].as_dict()
        if rank == 0:
            leave_lock(root["with"], built=args.built_from)
        dist.barrier()
        results["with"] = build(root["with"], 900)
        results["with"]["built_from"] = args.built_from
        results["with"]["stats"] = dict(zeroshim.stats("stale_build_lock"))
    else:
        zeroshim = enable_zeroshim()
        results["status"] = zeroshim.status()["stale_build_lock"].as_dict()
        where = root["held"] if args.holder == "build" else root["with"]  # "process": the stale launch's build
        child = held(where, args.holder) if rank == 0 else None
        dist.barrier()
        results["held"] = build(where, 900)
        results["held"]["stats"] = dict(zeroshim.stats("stale_build_lock"))
        if child is not None:
            results["held"]["holder_exit"] = child.wait()
    end(out, results)


if __name__ == "__main__":
    main()
