"""Test environments (the pinned matrix) and the demo.

    nox -s ci               what CI runs (the README's test command): every tests environment, the
                            accelerate client and packaging, each one's install done ahead of its tests
    nox -s tests            every environment of the matrix, one after another
    nox -s "tests(env='ds0.19.8')"   one of them
    nox -s demo             `zeroshim prove`: each patch that applies, without and with zeroshim
    nox -s canary           the newest DeepSpeed, transformers, peft and accelerate: every patch
                            must apply to a bug that still exists or say "not affected" (not in CI)
    nox -s clients          end to end inside real training frameworks (TRL, accelerate launch,
                            LLaMA-Factory, ms-swift, XTuner, axolotl, OpenRLHF) and in the shapes of seed systems' own
                            fine-tuning scripts (MiniCPM-V, Qwen), plainly and under `zeroshim-run`
                            (CI runs the accelerate one)
    nox -s deepspeed_suite  DeepSpeed's own ZeRO unit tests at the release's tag, plainly and with
                            zeroshim in every rank (not in CI: about an hour per release)
    nox -s differential     training configurations drawn from the axes users combine, without and
                            with zeroshim: none may differ (ZS_DIFF_SAMPLE=N; CI runs a small sample
                            inside tests(env='ds0.19.2'))
    nox -s packaging        build the sdist and wheel, check the wheel's files, install it beside
                            old pins (DeepSpeed 0.12.3, transformers 4.34.0): nothing may move
    nox -s docs             the docs site (mkdocs, warnings as errors): build/docs/site/

Each session is its own virtual environment.  torch is an axis (``TORCH_OF``):
2.13.0 (CPU build; on the CI machine pip takes that wheel from local disk) for
ds0.14.1, ds0.16.9, the light tf5.0.0, ds0.18.5, ds0.18.2 and tf4.45.2, the clients and packaging; 2.14.1 for
ds0.19.2; 2.15.0 for ds0.19.8 (both CUDA builds from PyPI that run on the CPU).
A tests session runs its files in 2 pytest-xdist workers (``NOX_WORKERS``).
Where a patch's launch tests run is not listed here: tests/conftest.py derives
it from each patch's gate (where affected, and the newest environment).  Elsewhere, set
``NOX_TORCH_INDEX_URL`` (e.g. ``https://download.pytorch.org/whl/cpu``) to take
CPU builds from PyTorch's index, ``NOX_WHEELHOUSE`` to a folder of downloaded
wheels, or ``NOX_TORCH`` to test another torch everywhere.  The pins live here,
never in pyproject.toml.
"""

import glob
import json
import os
import subprocess
import sys
import threading
import time
import zipfile

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = not os.environ.get("CI")
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests"]  # what `nox` alone runs (CI: `nox -s ci`)

TORCH = os.environ.get("NOX_TORCH")  # overrides every session's torch (e.g. "torch==2.16.0")
TORCH_DEFAULT = "torch==2.13.0"
TORCH_INDEX_URL = os.environ.get("NOX_TORCH_INDEX_URL")  # e.g. https://download.pytorch.org/whl/cpu
# A folder of wheels built once with `pip download` (e.g. torch 2.15.0's ~3 GB of CUDA wheels): pip looks
# there first.  pip's HTTP cache stays empty on these machines, so without it every new venv downloads
# them again.  Unset in CI (each environment is built once there).
WHEELHOUSE = os.environ.get("NOX_WHEELHOUSE")

# name -> packages installed on top of torch (DeepSpeed builds with DS_BUILD_OPS=0).
# Why these: 0.14.1 is the oldest DeepSpeed with a CPU accelerator that works
# here (<= 0.13 needs intel-extension-for-pytorch) and is inside the ranges of
# torch_elastic_compat and offload_clip_device; 0.16.9 is past both fixes;
# 0.19.2 is the last release before the frozen-parameter recompute fix
# (0.19.3); 0.19.8 is the latest.  transformers 4.49/4.57 default to reentrant
# checkpointing, 5.x to non-reentrant.
MATRIX = {
    "ds0.14.1": ["deepspeed==0.14.1", "transformers==4.49.*", "peft==0.14.*", "numpy<2", "accelerate==1.15.0"],
    "ds0.16.9": ["deepspeed==0.16.9", "transformers==4.49.*", "peft==0.14.*", "accelerate==1.15.0"],
    "ds0.19.2": ["deepspeed==0.19.2", "transformers==4.57.*", "peft==0.17.*", "accelerate==1.15.0"],
    "ds0.19.8": ["deepspeed==0.19.8", "transformers==5.23.*", "peft==0.21.*", "accelerate==1.15.0"],
    # light (LIGHT): transformers 5.0.0 shows zero3_conversion_dropped_keys's MoE form, and the 5.x form of
    # zero3_from_config_init (ds0.19.2 proves its 4.x form)
    "tf5.0.0": ["deepspeed==0.19.8", "transformers==5.0.0", "accelerate==1.15.0"],
    # light: DeepSpeed 0.18.3-0.18.x averages bf16 ZeRO-1's fp32-accumulated gradients without the boundary
    # micro-batch (bf16_zero1_last_microbatch); 0.18.3-0.18.5 divide bf16 gradients without ZeRO by a loss scale the
    # loss never got (bf16_zero0_grads); accelerate < 1.8 leaves DeepSpeed to count the accumulation steps
    # (accelerate_accumulation_boundary: a stack LLaMA-Factory allows, DeepSpeed <= 0.18.4 with accelerate >= 1.3)
    "ds0.18.5": ["deepspeed==0.18.5", "transformers==4.57.*", "accelerate==1.7.0"],
    # light: DeepSpeed 0.17.6-0.18.2's Muon optimizer drops the config's muon_lr and adam_lr (muon_group_lr)
    "ds0.18.2": ["deepspeed==0.18.2", "transformers==4.57.*", "accelerate==1.15.0"],
    # light: HF Trainer up to transformers 4.45 refuses "auto" bucket sizes for a model whose hidden size is only in
    # text_config (trainer_auto_hidden_size)
    "tf4.45.2": ["deepspeed==0.16.9", "transformers==4.45.2", "accelerate==1.15.0"],
}
# Light environments (issue #43 item 5): a stack for bugs no full environment shows; each runs only the test files
# (tests/test_<name>*.py) of the patches whose gate says affected there and whose range holds in no full environment
# (derived in the environment itself: tests/light.py), on TORCH_DEFAULT.
LIGHT = ("tf5.0.0", "ds0.18.5", "ds0.18.2", "tf4.45.2")
# torch is an axis of the matrix (issue #46): the newest DeepSpeed on the newest torch, 0.19.2 (inside
# the ranges of the most invasive patches, transformers 4.57 checkpointing reentrantly by default) on
# the torch before it, the older releases on 2.13.0.  Each torch release thus runs the whole suite with
# a DeepSpeed that installs beside it; the clients and packaging sessions stay on TORCH_DEFAULT.
# torch 2.14.1 and 2.15.0 are CUDA builds (about 5.5 GB in a venv; they run on the CPU): a bit-for-bit
# claim holds within one environment, never across the CPU and CUDA builds.
TORCH_OF = {"ds0.19.2": "torch==2.14.1", "ds0.19.8": "torch==2.15.0", "canary": "torch"}
DEMO_ENV = "ds0.19.8"
# Where the tests sessions write their timings (per-session wall times, per-launch JSON lines): read by
# .ci/timings.py at the end of .ci/run.
TIMINGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".ci-timings")
# Set by `nox -s ci` in the sessions it runs: "install" (`nox --install-only`) or "test" (`nox -R`).
PHASE = os.environ.get("ZSCI_PHASE", "")
# Environments whose DeepSpeed predates numpy 2 support: numpy 2 is also put in a
# side directory, and tests/test_numpy2_compat.py runs DeepSpeed with it first on
# PYTHONPATH (patch numpy2_compat), while the environment itself keeps numpy < 2.
NUMPY2_SIDE = {"ds0.14.1": "numpy==2.4.6"}


def _env(session, **extra):
    """DeepSpeed JIT-builds a small comm op into TORCH_EXTENSIONS_DIR; one per
    environment, so DeepSpeed versions never load each other's build."""
    env = {"OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": os.path.join(session.virtualenv.location, "torch_extensions")}
    env.update(extra)
    return env


# DeepSpeed's CPU comm op, built once before the tests rather than by the first test that launches ranks:
# a launch killed at its timeout in the middle of that build leaves torch's build lock behind, and every
# later launch then waits on it for good (torch.utils.file_baton; seen here when a timed-out launch was
# killed).  DeepSpeed < 0.15 has no such op.
PREBUILD_COMM_OP = ("import sys\n"
                    "try:\n    from deepspeed.comm.torch import build_shm_op\n"
                    "except Exception as exc:\n"
                    "    sys.exit(print('CPU comm op not prebuilt (DeepSpeed < 0.15 has none; 0.14 imports only with zeroshim):',\n"
                    "                   type(exc).__name__, exc))\n"
                    "build_shm_op()\n")


# pytest-xdist workers of a tests session (NOX_WORKERS; 0 runs the tests in pytest's own process).  A launch's 2
# ranks keep about one of this machine's 2 cores busy (they wait on each other in collectives, and on rank 0's
# saves; measured: 107 s wall for 102 s of CPU), so two files at a time fill both.  --dist loadfile: a test
# file's module-scoped launches run once, in one worker.
WORKERS = os.environ.get("NOX_WORKERS", "2")


def _workers() -> list:
    return [] if WORKERS in ("0", "1", "") else ["-n", WORKERS, "--dist", "loadfile"]


def _matrix_pins() -> dict:
    """The full environments (LIGHT left out), oldest first: package -> its pin (``0.19.2``, ``4.57.*``, or a
    range as written), torch included.  tests/conftest.py runs a patch's launches once per distinct stack of the
    packages its declaration names."""
    pins = {}
    for name, packages in MATRIX.items():
        if name in LIGHT:
            continue
        pins[name] = {}
        for spec in [_torch_spec(name), *packages]:
            package, _, version = spec.partition("==")
            if version:
                pins[name][package] = version
            else:
                split = next((i for i, c in enumerate(spec) if c in "<>=!~"), len(spec))
                pins[name][spec[:split]] = spec[split:] or "(unpinned)"
    return pins


def _torch_spec(env_name=None) -> str:
    return TORCH or TORCH_OF.get(env_name, TORCH_DEFAULT)


_SESSION_TORCH: dict = {}  # session name -> its torch requirement (nox's Session takes no attributes)


def _pip_env(session, **extra) -> dict:
    """The environment of every `pip install` of a session.  Where pip is capped by a constraints file
    (these machines cap torch at 2.14.1, the newest on their disk), a session whose torch is other than
    TORCH_DEFAULT (2.15.0, an unpinned canary, NOX_TORCH) installs with the cap lifted: otherwise a later
    install (DeepSpeed depends on torch) would take torch back down to the cap."""
    # no byte-compiling at install: half of an install's CPU time (transformers alone: 33 s with, 16 s without,
    # measured here), mostly for modules no test imports; the ones imported compile once, at first import
    env = {"PIP_NO_COMPILE": "1", **extra}
    if _SESSION_TORCH.get(session.name, TORCH_DEFAULT) != TORCH_DEFAULT:
        env["PIP_CONSTRAINT"] = "/dev/null"
    return env


def _pip(session, *args, **env) -> None:
    """Every `pip install` of a session after its torch: with the session's torch named again (DeepSpeed
    depends on torch, and nothing may move it; not for --target/--no-deps installs, which resolve nothing)
    and the cap lifted where the session's torch is above it (``_pip_env``)."""
    pin = [] if ("--target" in args or "--no-deps" in args) else [_SESSION_TORCH.get(session.name, TORCH_DEFAULT)]
    session.install(*pin, *args, env=_pip_env(session, **env))


def _install_torch(session, env_name=None):
    spec = _SESSION_TORCH[session.name] = _torch_spec(env_name)
    args = [spec] if "=" in spec else ["--upgrade", spec]  # unpinned (canary): the newest, even in a reused venv
    if TORCH_INDEX_URL:
        args += ["--index-url", TORCH_INDEX_URL]
    if WHEELHOUSE:
        args += ["--find-links", WHEELHOUSE]
    session.install(*args, env=_pip_env(session))


def _install(session, env_name):
    _install_torch(session, env_name)
    # torch named again: nothing else in the environment may move it
    _pip(session, *MATRIX[env_name], DS_BUILD_OPS="0")
    _pip(session, ".[test]")


@nox.session
@nox.parametrize("env", list(MATRIX))
def tests(session, env):
    """The test suite in one pinned environment.  Its wall time (install included) and every scenario
    launch (wall and start-up time) are written under TIMINGS for .ci/run's account (.ci/timings.py)."""
    started = time.time()
    os.makedirs(TIMINGS, exist_ok=True)
    launches, proofs = (os.path.join(TIMINGS, f"{kind}-{env}.jsonl") for kind in ("launches", "proofs"))
    for old in (launches, proofs):
        if os.path.exists(old):
            os.remove(old)
    _note_location(session)
    _install(session, env)
    # ZSLAUNCH_PREFORK: a launch's ranks are forked from a process that imported torch and DeepSpeed once, where
    # that is all they would have done first (zeroshim/_prefork.py; issue #43 item 3)
    extra = {"ZSTEST_ENV": env, "ZSTEST_LAUNCH_LOG": launches, "ZSTEST_PROOF_LOG": proofs,
             "ZSTEST_MATRIX": json.dumps(_matrix_pins()), "ZSLAUNCH_PREFORK": "1"}
    if env in NUMPY2_SIDE:
        side = os.path.join(session.virtualenv.location, "numpy2")
        _pip(session, "--no-deps", "--target", side, NUMPY2_SIDE[env])
        extra["ZSTEST_NUMPY2"] = side
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    # an install step: done by `nox --install-only`, skipped by `nox -R`
    session.run_install("python", "-c", PREBUILD_COMM_OP,
                        env=_env(session, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES=""))
    if PHASE == "install":
        return
    # only the test files of the patches a light environment proves (LIGHT), unless posargs name others
    files = []
    if env in LIGHT and not session.posargs:
        said = session.run("python", "tests/light.py", env=_env(session, **extra), silent=True)
        if said is None:  # `nox --install-only`: nothing was run
            return
        names = json.loads(said.rpartition("light patches: ")[2].splitlines()[0])
        session.log(f"{env} proves {', '.join(names) or 'no patch'} (tests/light.py)")
        files = sorted(f for name in names for f in glob.glob(f"tests/test_{name}.py")
                       + glob.glob(f"tests/test_{name}_*.py"))
        if not files:
            session.error(f"light environment {env}: no patch's bug is shown here alone (tests/light.py)")
    # `pytest` (not `python -m pytest`): the installed zeroshim is tested, not the source tree.
    try:
        session.run("pytest", "-p", "no:cacheprovider", "--durations=25", *(_workers() if not files else []),
                    *files, *session.posargs, env=_env(session, **extra))
    finally:
        with open(os.path.join(TIMINGS, "sessions.jsonl"), "a") as fh:
            fh.write(json.dumps({"session": session.name, "env": env, "torch": _SESSION_TORCH.get(session.name),
                                 "seconds": round(time.time() - started, 1),
                                 "phase": PHASE or "install and test"}) + "\n")


# What CI runs (`nox -s ci`, the README's test command), in this order.  Sessions with a test phase run their tests
# one after another; packaging, which checks its own installs, runs whole beside them.
CI_SESSIONS = [*(f"tests(env='{name}')" for name in MATRIX), "clients(framework='accelerate')", "packaging"]
CI_WHOLE_BESIDE = ("packaging",)
# Disk.  Every environment of CI_SESSIONS together takes about 20 GB (the two CUDA builds of torch 5.7 GB each);
# a CI machine's free disk varies (stop 58's CI ran out of it with all of them installed ahead, benchmarks/RESULTS.md
# §47).  So `nox -s ci` removes each environment once its tests are done (unless ZSCI_KEEP_ENVS=1), and an install
# starts ahead of the tests before it only where the disk has room for its peak (pip's downloads and unpacking
# beside the growing environment, measured in §47); else it waits for the environments before it to be removed,
# and past them it goes on and says how little room there is.
CI_KEEP_ENVS = os.environ.get("ZSCI_KEEP_ENVS") == "1"
GB = 1 << 30
CI_DISK_PEAK_GB = {"cuda": 9.0, "cpu": 2.0}  # an install's peak use, with a margin: 7.7 and 5.6 GiB (torch 2.15.0, 2.14.1), 1.2 GiB (2.13.0), §47


def _disk_peak(name: str) -> float:
    """An install's peak use of the disk, in bytes: a session on a torch other than TORCH_DEFAULT (PyPI's CUDA
    builds) or the default's CPU wheel."""
    env = name.partition("env='")[2].rstrip("')") or None
    return CI_DISK_PEAK_GB["cuda" if _torch_spec(env) != TORCH_DEFAULT else "cpu"] * GB


def _free(path: str) -> int:
    import shutil

    return shutil.disk_usage(path).free


def _file_safe(name: str) -> str:
    """A session's name as part of a file name (``tests(env='ds0.19.8')`` -> ``tests_env__ds0.19.8__``)."""
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in name)


def _location_file(name: str) -> str:
    """Where a session run by `nox -s ci` writes its environment's path (for `ci` to remove it after its tests)."""
    return os.path.join(TIMINGS, f"env-{_file_safe(name)}.path")


def _note_location(session) -> None:
    if PHASE:
        os.makedirs(TIMINGS, exist_ok=True)
        with open(_location_file(session.name), "w") as fh:
            fh.write(session.virtualenv.location)


# The installs beside the tests run at this niceness: the tests keep the CPU they would have alone, the installs
# take what they leave (pip's unpacking is CPU work; at niceness 0 the first environments' tests took 14-45 % longer
# on this 2-core machine, about what the overlap saved).
CI_INSTALL_NICE = 10


def _nox(name: str, phase: str, *options: str, **popen) -> subprocess.Popen:
    """`nox -s NAME` in a child process, with ZSCI_PHASE=PHASE (see PHASE)."""
    command = [sys.executable, "-m", "nox", "-f", os.path.abspath(__file__), "-s", name, *options]
    return subprocess.Popen(command, env={**os.environ, "ZSCI_PHASE": phase}, **popen)


@nox.session(venv_backend="none")
def ci(session):
    """CI: the sessions of CI_SESSIONS, as `nox -s <each>` one after another would run them, with every install
    done ahead: one install (`nox --install-only`: pip, DeepSpeed's comm op) at a time, in order, beside the tests of
    the sessions before it (at niceness CI_INSTALL_NICE), and each session's tests (`nox -R`) as soon as its own
    install is done.  Run one after the other, the installs were about a quarter of CI's time (issue #43); beside the
    tests they compete for the CPU (pip's unpacking), hence the niceness (benchmarks/RESULTS.md §16).  Each
    environment is removed once its tests are done, and an install waits for room on the disk (CI_DISK_PEAK_GB).
    An install's output goes to .ci-timings/install-<session>.log, printed when it fails; phases' times go to
    .ci-timings/ci.jsonl, the disk's least free space to .ci-timings/disk.json, for .ci/timings.py."""
    os.makedirs(TIMINGS, exist_ok=True)
    record = os.path.join(TIMINGS, "ci.jsonl")
    root = os.path.dirname(os.path.abspath(__file__))
    done = {name: threading.Event() for name in CI_SESSIONS}
    result = {name: {"session": name} for name in CI_SESSIONS}
    room = threading.Condition()
    on_disk = []  # sessions whose environment is installed (or installing) and not yet removed
    disk = {"start_gb": round(_free(root) / GB, 1), "least_gb": round(_free(root) / GB, 1), "while": "the start",
            "keep_envs": CI_KEEP_ENVS}
    now = {"doing": "the start"}
    finished = threading.Event()

    def sample():
        while not finished.wait(2.0):
            free = round(_free(root) / GB, 1)
            if free < disk["least_gb"]:
                disk.update(least_gb=free, **{"while": now["doing"]})

    def log_of(name):
        return os.path.join(TIMINGS, f"install-{_file_safe(name)}.log")

    def remove(name):
        """Remove ``name``'s environment (unless ZSCI_KEEP_ENVS=1) and let a waiting install go on."""
        try:
            with open(_location_file(name)) as fh:
                location = fh.read().strip()
        except OSError:
            location = ""
        if location and not CI_KEEP_ENVS and os.path.isdir(location):
            import shutil

            shutil.rmtree(location, ignore_errors=True)
        with room:
            if name in on_disk:
                on_disk.remove(name)
            room.notify_all()

    def installs():
        for name in CI_SESSIONS:
            whole = name in CI_WHOLE_BESIDE
            need, waited = _disk_peak(name), time.time()
            with room:
                # room for this install's peak, or nothing left to remove before it
                while on_disk and not CI_KEEP_ENVS and _free(root) < need:
                    room.wait(timeout=10)
                free = _free(root)
                on_disk.append(name)
            result[name]["waited_for_disk"] = round(time.time() - waited, 1)
            result[name]["free_gb_before"] = round(free / GB, 1)
            started = time.time()
            now["doing"] = f"{name}'s install"
            with open(log_of(name), "w") as out:
                if free < need:
                    out.write(f"ci: {free / GB:.1f} GB free on the disk, and this install takes up to about "
                              f"{need / GB:.0f} GB (noxfile.py CI_DISK_PEAK_GB); no environment is left to "
                              "remove before it, so it goes on\n")
                    out.flush()
                try:
                    child = _nox(name, "whole" if whole else "install", *([] if whole else ["--install-only"]),
                                 stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(CI_INSTALL_NICE))
                    rc = child.wait()
                except OSError as exc:
                    out.write(f"could not start nox: {exc}\n")
                    rc = 1
            result[name]["whole" if whole else "install"] = round(time.time() - started, 1)
            result[name]["install_rc"] = rc
            if whole:  # run whole here: its environment stays, and nothing waits for its removal
                with room:
                    on_disk.remove(name)
                    room.notify_all()
            done[name].set()

    threading.Thread(target=sample, name="ci-disk", daemon=True).start()
    threading.Thread(target=installs, name="ci-installs", daemon=True).start()
    failed = []

    def show(name, why):
        failed.append(name)
        session.warn(f"{name}: {why}; {_free(root) / GB:.1f} GB free on the disk now "
                     f"({result[name].get('free_gb_before', '?')} GB before its install); its output ({log_of(name)}):")
        with open(log_of(name), errors="replace") as fh:
            print(fh.read()[-20000:], flush=True)

    for name in CI_SESSIONS:
        if name in CI_WHOLE_BESIDE:
            continue
        waited = time.time()
        done[name].wait()
        result[name]["waited_for_install"] = round(time.time() - waited, 1)
        if result[name]["install_rc"]:
            show(name, f"its install failed (exit status {result[name]['install_rc']}); its tests did not run")
            remove(name)
            continue
        session.log(f"{name}: installed in {result[name]['install']:.0f} s (waited {result[name]['waited_for_install']:.0f} s)")
        started = time.time()
        now["doing"] = f"{name}'s tests"
        rc = _nox(name, "test", "-R").wait()
        result[name]["test"], result[name]["test_rc"] = round(time.time() - started, 1), rc
        if rc:
            failed.append(name)
        remove(name)
    for name in CI_WHOLE_BESIDE:
        done[name].wait()
        if result[name]["install_rc"]:
            show(name, f"failed (exit status {result[name]['install_rc']})")
        else:
            session.log(f"{name}: passed in {result[name]['whole']:.0f} s, beside the tests (its output: {log_of(name)})")
    finished.set()
    with open(record, "a") as fh:
        for name in CI_SESSIONS:
            fh.write(json.dumps(result[name]) + "\n")
    with open(os.path.join(TIMINGS, "disk.json"), "w") as fh:
        json.dump(disk, fh)
    for name in CI_SESSIONS:
        r = result[name]
        state = "failed" if name in failed else "passed"
        phases = (f"beside the tests {r.get('whole', 0):.0f} s" if name in CI_WHOLE_BESIDE else
                  f"install {r.get('install', 0):.0f} s (waited for {r.get('waited_for_install', 0):.0f} s), "
                  f"tests {r.get('test', 0):.0f} s")
        session.log(f"  {name:<34} {state}: {phases}")
    session.log(f"disk: {disk['start_gb']} GB free at the start, {disk['least_gb']} GB at the least (during "
                f"{disk['while']})")
    if failed:
        session.error(f"{len(failed)} of {len(CI_SESSIONS)} sessions failed: {', '.join(failed)}")


@nox.session
def bench(session):
    """The benchmark scripts' smoke runs (tests/test_benchmarks.py, marker ``bench``) in the newest
    environment; before a release (not in CI: about 3 minutes)."""
    _install(session, DEMO_ENV)
    session.run("python", "-c", PREBUILD_COMM_OP, env=_env(session, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES=""))
    session.run("pytest", "-p", "no:cacheprovider", "--durations=10", "tests/test_benchmarks.py", *session.posargs,
                env=_env(session, ZSTEST_ENV=DEMO_ENV, ZSTEST_BENCH="1"))


@nox.session
def demo(session):
    """`zeroshim prove` in the newest environment: every patch that applies there, reproduced on
    2 CPU ranks without zeroshim and with it, as a table (posargs go to `zeroshim prove`)."""
    _install(session, DEMO_ENV)
    session.run("zeroshim", "prove", *session.posargs, env=_env(session))


@nox.session
def canary(session):
    """The newest torch, DeepSpeed, transformers, peft and accelerate (unpinned; the
    pip cap on torch lifted): the whole suite, every test (no environment of the
    matrix to leave any to).  Every patch must apply to a bug that still exists or
    report "not affected" -- never "target changed" (tests/test_patch_kit.py) --
    and every reproduction must still fail without zeroshim where the gate says it
    should (the scenario tests).  Run it before every release and write its result
    in benchmarks/RESULTS.md; a red canary is an issue to file.  CI skips it."""
    _install_torch(session, "canary")
    # --upgrade: a reused environment must take the newest releases, not keep the last canary's
    _pip(session, "--upgrade", "deepspeed", "transformers", "peft", "accelerate", DS_BUILD_OPS="0")
    _pip(session, ".[test]")
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("python", "-c", PREBUILD_COMM_OP, env=_env(session, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES=""))
    # no ZSTEST_ENV: every test runs (nothing is left to another environment of the matrix)
    session.run("pytest", "-p", "no:cacheprovider", "--durations=25", *session.posargs, env=_env(session))


# Framework -> (its pinned stack, packages installed with --no-deps, native libraries removed after
# installing) for the end-to-end runs (tests/clients/).  Each framework is its own session, so one framework's pins never constrain
# another's.  DeepSpeed 0.19.2: inside zero3_frozen_recompute's range, so a framework's
# non-reentrant LoRA + ZeRO-3 run shows the failure without zeroshim.  LLaMA-Factory 0.9.5 requires
# torchvision and torchaudio: the torchvision built for torch 2.13 is a CUDA build that fails to
# import (text SFT does not need it), and torchaudio must import, so LLaMA-Factory and torchaudio
# come without their dependencies, the rest of its requirements are listed here, and torchaudio's
# native libraries (built against CUDA torch: "libc10_cuda.so: cannot open shared object file") are
# removed, which torchaudio's loader accepts.  XTuner 0.2.0 pins mmengine 0.10.6, transformers 4.48.0 and
# (extra "deepspeed") DeepSpeed 0.16.2, inside zero2_offload_accumulation's range; it comes without its
# dependencies because it requires bitsandbytes (CUDA, unused by full fine-tuning) and torchvision (the
# only build for torch 2.13 here is a CUDA one that fails to import; tests/clients/xtuner_stubs/ stands
# in for it and for mmengine's unconditional torch.cuda.set_device: see tests/clients/xtuner_cases.py).
CLIENTS = {
    "trl": (["deepspeed==0.19.2", "trl==1.16.0", "transformers==5.23.*", "peft==0.21.*", "accelerate==1.15.0",
             "datasets==5.2.0"], [], []),
    "accelerate": (["deepspeed==0.19.2", "transformers==5.23.*", "peft==0.21.*", "accelerate==1.15.0"], [], []),
    "llamafactory": (["deepspeed==0.19.2", "transformers==5.6.0", "peft==0.18.1", "accelerate==1.11.0",
                      "trl==0.24.0", "datasets==4.0.0", "av", "einops", "fire", "matplotlib", "omegaconf", "pandas",
                      "protobuf", "pydantic", "pyyaml", "safetensors", "scipy", "sentencepiece", "tiktoken",
                      "tyro<0.9.0"],
                     ["llamafactory==0.9.5", "torchaudio==2.11.0", "torchdata==0.11.0"], ["torchaudio/lib"]),
    "swift": (["deepspeed==0.19.2", "ms-swift==4.6.0", "transformers==5.19.0", "peft==0.20.0", "trl==0.29.1",
               "accelerate==1.15.0", "datasets==4.8.4", "modelscope==1.40.2"], [], []),
    "xtuner": (["deepspeed==0.16.2", "mmengine==0.10.6", "transformers==4.48.0", "peft==0.14.0", "accelerate==1.2.1",
                "datasets==3.2.0", "einops", "loguru", "scipy", "sentencepiece", "tiktoken",
                "transformers-stream-generator", "opencv-python-headless", "scikit-image", "openpyxl"],
               ["xtuner==0.2.0"], []),
    # axolotl 0.19.0: the only release for Python 3.11 + torch 2.13 (0.20 and later require Python
    # >= 3.12, 0.18 torch <= 2.12.1).  Without its dependencies: it requires xformers (whose wheels pin
    # a CUDA torch), gradio, modal, lm_eval, cloud filesystems and more that `axolotl train` does not
    # import for LoRA on a CPU; its pins for the rest are kept.  DeepSpeed is the newest of its extra's
    # range (>=0.18.6,<0.19.0), without deepspeed-kernels (CUDA).  Imported at module level on the
    # `axolotl train` path, so installed (--no-deps, they import without a GPU): axolotl-contribs-lgpl
    # (axolotl/train.py), bitsandbytes (loaders/adapter.py) and triton (monkeypatch/trainer/utils.py;
    # about 1 GB of the environment's 3 GB).  See tests/clients/axolotl_cases.py.
    "axolotl": (["deepspeed==0.18.9", "transformers==5.16.1", "peft==0.20.0", "accelerate==1.13.0", "trl==1.9.0",
                 "datasets==4.8.4", "tokenizers==0.23.1", "huggingface_hub==1.17.0", "pydantic==2.12.5", "addict",
                 "colorama", "fire", "numba", "pandas", "posthog", "psutil", "pyarrow", "termcolor",
                 "evaluate==0.4.1", "wandb", "fastcore", "pillow", "httpx", "pyyaml", "requests", "sentencepiece",
                 "einops", "scipy", "click", "python-dotenv"],
                ["axolotl==0.19.0", "axolotl-contribs-lgpl==0.0.7", "axolotl-contribs-mit==0.0.6",
                 "bitsandbytes==0.50.2", "triton==3.9.0"], []),
    # OpenRLHF 0.11.2 requires flash-attn 2.8.3 (a CUDA source build), ray, bitsandbytes and pins DeepSpeed
    # 0.19.6: it comes without its dependencies, with the ones its DPO and reward-model paths import listed
    # here (DeepSpeed 0.19.2 as the other clients, inside zero3_frozen_recompute's range; transformers 5.15.0
    # its own pin);
    # tests/clients/openrlhf_stubs/ stands in for flash_attn and for its unconditional torch.cuda calls.
    "openrlhf": (["deepspeed==0.19.2", "transformers==5.15.0", "peft==0.21.2", "accelerate==1.15.0",
                  "datasets==4.8.4", "einops", "sympy", "pylatexenc", "tqdm", "tensorboard"],
                 ["openrlhf==0.11.2", "torchdata==0.11.0"], []),
    # Shapes of the seed systems' own fine-tuning scripts (no framework package: the script is
    # ours, tests/clients/<name>_*.py).  The ds0.19.2 test environment's stack: transformers 4.57
    # defaults to reentrant checkpointing and DeepSpeed 0.19.2 is inside zero3_frozen_recompute's range.
    "minicpmv": (["deepspeed==0.19.2", "transformers==4.57.*", "peft==0.17.*", "accelerate==1.15.0"], [], []),
    "qwen": (["deepspeed==0.19.2", "transformers==4.57.*", "peft==0.17.*", "accelerate==1.15.0"], [], []),
}

# Framework -> a second DeepSpeed, installed without dependencies into a side directory of the same
# environment (ZSCLIENT_SIDE_DEEPSPEED), for reference runs of settings that fail plainly on the
# pinned one: OpenRLHF's LoRA runs fail plainly on 0.19.2 (zero3_mixed_dtype_gather,
# zero3_frozen_recompute); 0.19.8 is past both bugs and past zero3_gloo_gather's race.
CLIENT_SIDE_DEEPSPEED = {"openrlhf": "deepspeed==0.19.8"}


@nox.session
@nox.parametrize("framework", list(CLIENTS))
def clients(session, framework):
    """The user's command of a real training framework on 2 CPU ranks, plainly and under
    `zeroshim-run` with the command unchanged: trains, says which patches acted, same
    losses as the plain run wherever that trains (tests/clients/run.py; CI runs `accelerate`)."""
    pinned, no_deps, strip = CLIENTS[framework]
    _note_location(session)
    _install_torch(session)
    _pip(session, *pinned, DS_BUILD_OPS="0")
    if no_deps:
        _pip(session, "--no-deps", *no_deps)
    for folder in strip:
        session.run_install("python", "-c", "import glob, os, sys, sysconfig; [os.remove(p) for p in glob.glob("
                    "os.path.join(sysconfig.get_path('purelib'), sys.argv[1], '*.so'))]", folder)
    extra = {}
    if framework in CLIENT_SIDE_DEEPSPEED:
        side = os.path.join(session.virtualenv.location, "side-deepspeed")
        # not reinstalled when present: new file times would make its JIT ops rebuild (minutes here)
        if not glob.glob(os.path.join(side, CLIENT_SIDE_DEEPSPEED[framework].replace("==", "-") + ".dist-info")):
            _pip(session, "--no-deps", "--upgrade", "--target", side, CLIENT_SIDE_DEEPSPEED[framework],
                 DS_BUILD_OPS="0")
        extra["ZSCLIENT_SIDE_DEEPSPEED"] = side
    _pip(session, ".")
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("python", "tests/clients/run.py", "--framework", framework, *session.posargs,
                env=_env(session, **extra))


# DeepSpeed's own unit tests, without and with zeroshim active in every rank (tests/dsunit/run.py):
# the newest release of the matrix, and 0.19.2, inside the ranges of the most invasive patches
# (zero3_frozen_recompute, zero3_delegating_wrapper).  The tests come from DeepSpeed's git
# repository at the release's tag (the sdist has no tests/), cached outside this tree; with the CPU
# adaptations (tests/dsunit/cpu_harness.py) the tests run to their end, about an hour per run on 2
# cores (plain, then zeroshim), so not in CI: run before each release (README).
#   nox -s "deepspeed_suite(release='0.19.2')" -- [--repo PATH_OR_URL] [--ref REF] [--all] [--reruns N]
#       [--only TEST_ID ...] [--resume] [--stop-at HH:MM] [-- PYTEST_ARGS]
# release -> packages.  0.19.5 is the newest tag the DeepSpeed mirror here reaches (0.19.8's tests then
# come from master, and the report says so); it has no environment of its own in MATRIX, so it takes
# 0.19.2's pins with its own DeepSpeed.
DEEPSPEED_SUITE = {"0.19.2": MATRIX["ds0.19.2"],
                   "0.19.5": ["deepspeed==0.19.5", *MATRIX["ds0.19.2"][1:]],
                   "0.19.8": MATRIX["ds0.19.8"]}


@nox.session
@nox.parametrize("release", list(DEEPSPEED_SUITE))
def deepspeed_suite(session, release):
    """DeepSpeed's ZeRO, offload and ZeRO-checkpoint unit tests at the release's tag, plainly and with
    zeroshim in every rank: fails if a test that passes without zeroshim does not pass with it."""
    _install_torch(session)
    _pip(session, *DEEPSPEED_SUITE[release], DS_BUILD_OPS="0")
    _pip(session, "pytest>=7.2.0,<8.4.0", "pytest-forked")  # the bounds of DeepSpeed's requirements-dev.txt
    _pip(session, ".")
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("python", "tests/dsunit/run.py", "--release", release,
                "--out", os.path.join(session.virtualenv.location, "results"), *session.posargs, env=_env(session))


# The differential matrix (tests/differential/run.py, issue #28): configurations drawn from the axes users
# combine, each trained without and with zeroshim and classified (same / fixed / failed both ways / differ).
# 0.19.2: inside the ranges of the most invasive patches.  CI runs a small sample inside
# tests(env='ds0.19.2') (tests/test_differential.py); the larger sample runs before a release:
#   ZS_DIFF_SAMPLE=40 nox -s differential -- --table differential.md
DIFFERENTIAL_ENV = "ds0.19.2"


@nox.session
def differential(session):
    """Training configurations without and with zeroshim, classified; fails if any differs
    (ZS_DIFF_SAMPLE configurations, default 6, after the known-bug anchors; posargs go to run.py)."""
    _install(session, DIFFERENTIAL_ENV)
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("python", "tests/differential/run.py", *session.posargs, env=_env(session))


# The docs site (zeroshim/_docs.py says why mkdocs): the pins of its build.
DOCS_PINS = ["mkdocs==1.6.1", "mkdocs-material==9.*"]


@nox.session
def docs(session):
    """The docs site: the README as the home page, a page per patch generated from its declaration
    (docs/patches/, checked current first), the reference pages, RESULTS and the CHANGELOG, built by mkdocs with
    warnings as errors (a broken link, a page left out of the navigation).  Writes build/docs/site/."""
    session.install(*DOCS_PINS, env={"PIP_NO_COMPILE": "1"})
    session.install("--no-deps", ".")
    session.install("packaging", "wrapt")
    session.run("python", "-m", "zeroshim._docs", "--check", "README.md")
    session.run("python", "-c", "from zeroshim import _docs; _docs.stage('build/docs', '.')")
    session.run("mkdocs", "build", "--strict", "-f", "build/docs/mkdocs.yml", env={"NO_MKDOCS_2_WARNING": "1"})
    session.log("site: build/docs/site/index.html")


# `nox -s packaging`: the pins a user may hold that zeroshim must install beside without moving
# anything.  Both are below what 0.1.0 required (deepspeed>=0.14, transformers>=4.35), where
# `pip install deepspeed==0.12.3 transformers==4.34.0 zeroshim` ended in ResolutionImpossible.
# DeepSpeed 0.12.3 builds from its sdist with DS_BUILD_OPS=0 on torch 2.13.0; it does not import
# there without zeroshim (torch_elastic_compat), so this also shows doctor working beside a
# DeepSpeed that is broken as installed.
PACKAGING_PINS = ["deepspeed==0.12.3", "transformers==4.34.0"]
# Added by installing the wheel where absent; anything else that appears, disappears or changes
# version fails the session.
PACKAGING_DEPENDENCIES = {"wrapt", "packaging"}
# Build output that means the packaging configuration is out of date or ambiguous.
BUILD_WARNINGS = ("Deprecat", "Package would be ignored", "is absent from the `packages` configuration")


def _frozen(session) -> dict:
    out = session.run("python", "-m", "pip", "list", "--format=freeze", silent=True)
    return dict(line.split("==", 1) for line in out.splitlines() if "==" in line)


def _expected_wheel_files() -> set:
    """What the wheel must hold from patches/ (as zeroshim/patches/): every module, and every
    patch folder's logs/*.log, derived from the tree (no list of patch names)."""
    expected = set()
    for path in glob.glob("patches/**/*.py", recursive=True) + glob.glob("patches/**/logs/*.log", recursive=True):
        if "__pycache__" not in path:
            expected.add("zeroshim/" + path.replace(os.sep, "/"))
    return expected


def _check_wheel(session, wheel: str) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    problems = []
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        problems.append("no LICENSE in the wheel's .dist-info/licenses/")
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    if top != {"zeroshim"}:
        problems.append(f"top-level entries other than zeroshim: {sorted(top - {'zeroshim'})}")
    problems += [f"shipped: {n}" for n in sorted(names) if "/tests/" in f"/{n}" or "__pycache__" in n]
    shipped = {n for n in names if n.startswith("zeroshim/patches/")}
    problems += [f"missing from the wheel: {n}" for n in sorted(_expected_wheel_files() - shipped)]
    problems += [f"in the wheel but not in patches/: {n}" for n in sorted(shipped - _expected_wheel_files())]
    for folder in sorted(glob.glob("patches/*/__init__.py")):  # a patch folder: its module, reproduction, judge
        name = folder.split(os.sep)[1]
        for part in ("__init__.py", "scenario.py", "proof.py"):
            if f"zeroshim/patches/{name}/{part}" not in names:
                problems.append(f"patch {name} has no {part} in the wheel")
    if "zeroshim/scenarios/common.py" not in names:
        problems.append("zeroshim/scenarios/common.py is not in the wheel")
    if problems:
        session.error("the wheel is wrong:\n  " + "\n  ".join(problems))
    session.log(f"{os.path.basename(wheel)}: {len(names)} files; LICENSE, patches, scenarios/common.py present; no tests")


@nox.session
def packaging(session):
    """The released artefacts: sdist and wheel (built from the sdist, as PyPI users get it; no
    setuptools warnings), the wheel's contents, and `pip install` of it beside old pins of what
    zeroshim patches: nothing but zeroshim (and wrapt/packaging where absent) may appear or move;
    then `import zeroshim` (importing none of torch/deepspeed/transformers), `zeroshim doctor`,
    and `zeroshim explain` on every shipped log."""
    dist = os.path.join(session.virtualenv.location, "dist")
    for old in glob.glob(os.path.join(dist, "*")):
        os.remove(old)
    # `build` in a side environment, so the session's own stays what a user's would be.
    builder = os.path.join(session.virtualenv.location, "builder")
    builder_python = os.path.join(builder, "bin", "python")
    if not os.path.exists(builder_python):
        session.run("python", "-m", "venv", builder)
    session.run(builder_python, "-m", "pip", "install", "-q", "build", external=True)
    log = session.run(builder_python, "-m", "build", "--outdir", dist, ".", external=True, silent=True)
    warnings = [line for line in log.splitlines() if any(w in line for w in BUILD_WARNINGS)]
    if warnings:
        session.error("the build warned:\n" + "\n".join(warnings))
    (wheel,) = glob.glob(os.path.join(dist, "*.whl"))
    _check_wheel(session, wheel)

    _install_torch(session)
    _pip(session, *PACKAGING_PINS, DS_BUILD_OPS="0")
    before = _frozen(session)
    _pip(session, wheel)
    after = _frozen(session)
    moved = [f"{name}: {before.get(name, 'absent')} -> {after.get(name, 'absent')}"
             for name in sorted(set(before) | set(after))
             if before.get(name) != after.get(name)
             and not (name == "zeroshim" or (name in PACKAGING_DEPENDENCIES and name not in before))]
    if moved:
        session.error("installing zeroshim moved the environment:\n  " + "\n  ".join(moved))
    session.log("installed beside " + ", ".join(f"{p}=={before[p]}" for p in ("torch", "deepspeed", "transformers"))
                + "; added: " + ", ".join(f"{n}=={after[n]}" for n in sorted(set(after) - set(before))))

    # -I: the installed copy, not the source tree in the current directory
    session.run("python", "-I", "-c", "import sys, zeroshim; "
                "loaded = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]; "
                "assert not loaded, loaded; assert 'site-packages' in zeroshim.__file__, zeroshim.__file__; "
                "print('import zeroshim', zeroshim.__version__, 'from', zeroshim.__file__)")
    session.run("zeroshim", "doctor", env=_env(session))
    logs = session.run("python", "-I", "-c", "import glob, os, zeroshim.patches as p; print(*sorted(glob.glob("
                       "os.path.join(os.path.dirname(p.__file__), '*', 'logs', '*.log'))), sep=chr(10))",
                       silent=True).split()
    for path in logs:  # each is a real failure a patch's signatures must recognise (exit status 0)
        session.run("zeroshim", "explain", path, env=_env(session))
