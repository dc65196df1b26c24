"""DeepSpeed's own unit tests, without and with zeroshim (``nox -s deepspeed_suite``).

    python tests/dsunit/run.py --release 0.19.2 [--repo PATH_OR_URL] [--ref REF] [--out DIR]
                               [--all] [--reruns N] [--reuse] [--resume] [--stop-at HH:MM]
                               [-- PYTEST_ARGS...]

1. DeepSpeed's ``tests/`` at the release's tag (``v<release>``): the sdist does
   not carry them, so they are taken from a git repository of DeepSpeed (a local
   clone or mirror, or a URL; ``$ZEROSHIM_DS_REPO``, default GitHub) into a cache
   outside this repository (``$ZEROSHIM_CACHE``, default ``~/.cache/zeroshim``).
   ``--ref`` runs another ref's tests; the report then says they are not the
   release's own.
2. The files below (``SUBSET``) run with DeepSpeed's own settings (its
   ``pytest.ini`` markers, ``--forked``, its ``DistributedTest`` ranks on the CPU
   accelerator with gloo), first plainly, then under ``zeroshim-run`` so every
   rank DeepSpeed's harness starts imports zeroshim first (the same start-up
   activation a user's launcher gets).  A probe test (probe_zeroshim.py) runs
   first in both and checks that claim in the ranks themselves.  In both runs,
   every process also gets cpu_harness.py's adaptations of the tests' GPU-only
   *reference* code to the CPU accelerator (the DDP reference's ``device_ids``,
   the cross-rank comparison helper's device and 0-d all-gather), never of
   DeepSpeed itself; the report counts the tests each one acted in
   (``ZS_DSUNIT_CPU_HARNESS=0`` turns them off).  DeepSpeed's C++ ops that
   the tests JIT-build are built once before the runs (``PREBUILT_OPS``).
3. The zeroshim run re-runs every test that did not skip in the plain run (the
   skips are DeepSpeed's own environment checks: fp16 not supported on this CPU,
   more ranks than ``LOCAL_SIZE``, "CPU accelerator does not support this
   test"), in ``SUBSET``'s order; ``--all`` re-runs the skipped ones too.  The
   whole subset takes about an hour per run on 2 cores: ``--stop-at HH:MM``
   stops the zeroshim run (and the reruns) at that time, and the report lists
   the tests it did not reach, which are not compared; ``--resume`` keeps the
   plain run already in the results folder and does the rest.
4. Every test whose outcome differs runs again, ``--reruns`` times (default 3)
   in each mode, interleaved: DeepSpeed has tests that flip on their own (a
   test that also fails without zeroshim in a rerun is reported as flaky, with
   its counts, not as zeroshim's).  ``--only TEST_ID`` (repeatable) runs just
   those tests (node ids under DeepSpeed's ``tests/``, a file or class selects
   all its tests) and reruns every one of them, differing or not: to count how
   often a test flips on its own.
5. Per test: outcome and time in both runs, and the zeroshim INFO lines logged
   while it ran (which patches acted).  Exit 1 if a test that passed without
   zeroshim in every run did not pass with it in some run (listed), 2 if the
   run itself could not be done.  ``--reuse`` redoes 4-5 from an earlier run's
   results.json.

Results: ``DIR/report.md`` and ``DIR/results.json``, logs ``DIR/{plain,zeroshim}.log``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent

# DeepSpeed's CPU CI (.github/workflows/cpu-torch-latest.yml) runs all of tests/unit with `--forked -n 4`
# (hours on 2 cores); this is the part of it where zeroshim's patches act: ZeRO-1/2/3 engines and the
# stage-3 parameter coordinator (zero3_frozen_recompute, zero3_dummy_loss, zero3_delegating_wrapper,
# zero3_moe_leaf, nonreentrant_checkpoint), CPU offload and gradient accumulation (offload_worker_fork,
# zero2_offload_accumulation, epoch_boundary), and ZeRO checkpoint save/load (checkpoint_weights_only).
# Left out: the large parameter grids of tests/unit/v1/zero/test_zero_tensor_fragment.py (218 tests),
# checkpoint/test_universal_checkpoint.py (144) and v1/zero/test_offload_states.py (128, accelerator
# offload states), and runtime/activation_checkpointing (73 tests, every one skips on the CPU
# accelerator: "CPU accelerator does not support this test yet").
# The zeroshim run follows this order (not the plain run's): with --stop-at, what a stopped run has not
# reached is the end of the list, so test_zero.py (ZeRO engine basics, 76 tests at v0.19.5, where the
# patches rarely act) comes last.
SUBSET = [
    "unit/v1/zero/test_zero_user_backward.py",
    "unit/v1/zero/test_zero2_offload_multi_backward.py",
    "unit/v1/zero/test_zero_cpu_offload_grad_accum.py",
    "unit/v1/zero/test_zero_hook_count_regression.py",
    "unit/runtime/zero/test_zero_leaf_module.py",
    "unit/runtime/zero/test_zero_late_module_attach.py",
    "unit/runtime/zero/test_zero_context.py",
    "unit/runtime/zero/test_zero_context_return.py",
    "unit/runtime/zero/test_zero_context_ancestry.py",
    "unit/runtime/zero/test_zero_nesting_init.py",
    "unit/runtime/zero/test_zero_dynamic_class.py",
    "unit/runtime/zero/test_zero_offloadpp.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/zero/test_ignore_unused_parameters.py",
    "unit/runtime/zero/test_unwrap_model.py",
    "unit/checkpoint/test_zero_optimizer.py",
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/v1/zero/test_zero.py",
]
PROBE = "unit/test_zeroshim_probe.py"
PROBE_ID = f"{PROBE}::TestZeroshimProbe::test_zeroshim_in_every_rank"


def die(msg: str) -> "NoReturn":  # noqa: F821
    print(f"deepspeed_suite: {msg}", file=sys.stderr)
    sys.exit(2)


def git(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True)


def tests_at(ref: str, repo: str, cache: Path) -> tuple[Path, str]:
    """DeepSpeed's tests/ at ``ref``, extracted once into the cache; returns (tests dir, commit)."""
    local = Path(repo).expanduser()
    tmp = None
    if local.exists():
        git_dir = local / ".git" if (local / ".git").exists() else local
    else:  # a URL: a shallow clone of the tag only
        tmp = tempfile.mkdtemp(prefix="ds-clone-")
        done = git("clone", "--quiet", "--bare", "--depth", "1", "--branch", ref, repo, tmp)
        if done.returncode:
            die(f"cannot clone {repo} at {ref}: {done.stderr.decode().strip()}\n"
                "  (no network? point ZEROSHIM_DS_REPO / --repo at a local DeepSpeed clone or mirror)")
        git_dir = Path(tmp)
    try:
        found = git("--git-dir", str(git_dir), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        if found.returncode:
            die(f"{ref} is not in {repo}; fetch the tag there, or pass --ref to run another ref's tests "
                "(the report then says they are not the release's own)")
        commit = found.stdout.decode().strip()
        dest = cache / "deepspeed-tests" / commit
        if not (dest / "tests" / "unit" / "common.py").exists():
            archive = git("--git-dir", str(git_dir), "archive", "--format=tar", commit, "tests")
            if archive.returncode:
                die(f"git archive {commit} tests failed: {archive.stderr.decode().strip()}")
            partial = dest.with_name(commit + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                tar.extractall(partial, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(partial)
            shutil.rmtree(dest, ignore_errors=True)
            partial.rename(dest)
        return dest / "tests", commit
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def base_env(out: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ZEROSHIM_") and k not in ("PYTHON_ZEROSHIM_ENV", "PYTHONPATH")}
    env.update(
        # site/sitecustomize.py (cpu_harness.py's adaptations in every process) and the zs_outcomes plugin
        PYTHONPATH=os.pathsep.join([str(HERE / "site"), str(HERE)]),
        PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
        # DeepSpeed's CPU accelerator counts devices from LOCAL_SIZE (else NUMA nodes: 1 here);
        # 2 ranks per test, as DistributedTest's default world size.
        LOCAL_SIZE="2",
        DS_UNITTEST_TIMEOUT="300",  # a hang ends the run after 5 minutes, not DeepSpeed's 10
        HF_HOME=str(out / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return env


def clean_shm(before: set) -> None:
    """DeepSpeed's CPU comm op leaves shared-memory buffers per launch: remove the ones that appeared
    during this run and that no live process maps (a concurrent DeepSpeed run's buffers stay: deleting
    them made that run's ranks wait for each other's buffer until DeepSpeed's hang timeout)."""
    from zeroshim import _launch  # installed in the suite's environment (the zeroshim run needs it)

    _launch.remove_new_shm_buffers(before)


def keep_probe(extra: list[str]) -> list[str]:
    """pytest arguments with every ``-k EXPR`` widened to ``(EXPR) or <the probe>``: a ``-k`` that
    deselected the probe would end each run with "the probe failed"."""
    probe = PROBE_ID.rsplit("::", 1)[1]
    out, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if arg == "-k" and i + 1 < len(extra):
            out += ["-k", f"({extra[i + 1]}) or {probe}"]
            i += 2
            continue
        if arg.startswith("-k") and len(arg) > 2:
            out.append(f"-k({arg[2:]}) or {probe}")
        else:
            out.append(arg)
        i += 1
    return out


def pytest_run(mode: str, tests_dir: Path, ids: list[str], out: Path, extra: list[str], name: str = "",
               stop_at: float | None = None, zs_env: dict | None = None) -> dict:
    """One pytest run of ``ids``.  ``stop_at`` (epoch seconds): pytest gets SIGINT then, so it ends after
    writing the outcomes it has (the test it was in is not recorded); the result says ``stopped``.
    ``zs_env``: zeroshim flags (``--zeroshim-env``) for a zeroshim run."""
    name = name or mode  # the run's files: NAME.json, NAME.log, probe.NAME.<rank>.json
    env = base_env(out)
    env.update(ZS_DSUNIT_OUTCOMES=str(out / f"{name}.json"), ZS_DSUNIT_PROBE=str(out / f"probe.{name}"),
               ZS_DSUNIT_EXPECT="on" if mode == "zeroshim" else "off")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "zs_outcomes",
           "--forked", "-rfEs", *keep_probe(extra), *ids]
    zslog = out / f"{name}-records"
    harnesslog = out / f"{name}-harness"
    harnesslog.mkdir()
    env["ZS_DSUNIT_HARNESSLOG"] = str(harnesslog / "log")
    if mode == "zeroshim":  # zeroshim-run puts its bootstrap first; it chains to site/sitecustomize.py
        zslog.mkdir()
        env.update(ZEROSHIM_LOG_LEVEL="INFO", ZS_DSUNIT_ZSLOG=str(zslog / "log"))
        env.update(zs_env or {})
        cmd = ["zeroshim-run", *cmd]
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    start = time.time()
    stopped = False
    with open(out / f"{name}.log", "w") as log:
        # its own process group: what a stopped run leaves running (the test's ranks) is killed with it
        proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            try:
                code = proc.wait(timeout=None if stop_at is None else max(stop_at - time.time(), 1))
            except subprocess.TimeoutExpired:
                stopped = True
                proc.send_signal(signal.SIGINT)  # pytest's own interrupt: its session ends, outcomes written
                try:
                    code = proc.wait(timeout=120)
                except subprocess.TimeoutExpired:  # zs_outcomes has written the outcomes after every test
                    proc.kill()
                    code = proc.wait()
        except BaseException:  # run.py itself interrupted (Ctrl-C, nox): pytest is in its own group, stop it too
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            raise
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group: a test's forked child, its ranks
            except OSError:
                pass
    clean_shm(before)
    wall = time.time() - start
    try:
        result = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        die(f"the {name} run wrote no outcomes (exit {code}); see {out / (name + '.log')}")
    result.update(exit=code, wall=round(wall, 1), acted=acted_lines(zslog) if mode == "zeroshim" else {},
                  harness=harness_fixes(harnesslog), stopped=stopped,
                  stop_at=time.strftime("%H:%M", time.localtime(stop_at)) if stopped else None)
    return result


def resumed_plain(out: Path) -> dict:
    """The plain run already in ``out`` (--resume), as pytest_run returned it."""
    try:
        result = json.loads((out / "plain.json").read_text())
    except (OSError, ValueError):
        die(f"--resume: no finished plain run in {out} (plain.json)")
    if result.get("exitstatus") not in (0, 1):  # 2: interrupted, 3: internal error, 4: usage error
        die(f"--resume: the plain run in {out} did not finish (pytest exit {result.get('exitstatus')})")
    result.update(exit=result.get("exitstatus"), wall=result.get("seconds", 0.0), acted={},
                  harness=harness_fixes(out / "plain-harness"), stopped=False)
    return result


def remove_runs(out: Path, *patterns: str) -> None:
    """Delete the files and folders of earlier runs in ``out`` that match ``patterns`` (to be done again)."""
    for path in {p for pattern in patterns for p in out.glob(pattern)}:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def in_subset_order(ids: list[str]) -> list[str]:
    """``ids`` grouped by their file's place in SUBSET (stable inside a file; others last)."""
    def place(test):
        path = test.split("::")[0]
        return SUBSET.index(path) if path in SUBSET else len(SUBSET)

    return sorted(ids, key=place)


def harness_fixes(folder: Path) -> dict:
    """cpu_harness.py's adaptations that acted, per test (from every process of the run)."""
    fixes = {}
    for rec in _records(folder):
        names = fixes.setdefault(rec["test"] or "(outside a test)", [])
        if rec["fix"] not in names:
            names.append(rec["fix"])
    return fixes


def _records(folder: Path):
    """The JSON records of every process's ``log.*`` file in ``folder`` (other lines skipped)."""
    for path in sorted(folder.glob("log.*")):
        for raw in path.read_text(errors="replace").splitlines():
            try:
                yield json.loads(raw)
            except ValueError:
                continue


# DeepSpeed JIT-builds these C++ ops on first use (DS_BUILD_OPS=0): the CPU comm op in every
# DistributedTest, cpu_adam in the offload tests, fused_adam (the CPU accelerator's FusedAdam) wherever
# a test's config asks for "Adam".  Built inside a test, the build counts against
# DeepSpeed's hang timeout (DS_UNITTEST_TIMEOUT) and took over 5 minutes on a busy 2-core machine,
# so the first test (the probe) ended as "hanged".  Built here once, before the runs, into
# TORCH_EXTENSIONS_DIR, where the ranks load them from.
PREBUILT_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder")


def prebuild_ops(out: Path) -> None:
    code = ("import sys\nfrom deepspeed.accelerator import get_accelerator\n"
            "for name in sys.argv[1:]:\n    get_accelerator().create_op_builder(name).load()\n")
    with open(out / "prebuild.log", "w") as log:
        done = subprocess.call([sys.executable, "-c", code, *PREBUILT_OPS], env=base_env(out),
                               stdout=log, stderr=subprocess.STDOUT)
    if done:
        die(f"building DeepSpeed's ops {PREBUILT_OPS} failed; see {out / 'prebuild.log'}")


def acted_lines(folder: Path) -> dict:
    """zeroshim's INFO/WARNING lines (rank 0's, as a user sees them; other ranks log these at DEBUG),
    per test, from every process of the zeroshim run (site/sitecustomize.py writes them), without the
    "applied" lines every process logs when DeepSpeed is imported."""
    acted = {}
    for rec in _records(folder):
        if rec["level"] == "DEBUG" or re.match(r"zeroshim: applied \w+ \(", rec["msg"]):
            continue
        text = f"{rec['level']} {rec['msg']}"[:300]
        lines = acted.setdefault(rec["test"] or "(outside a test)", [])
        if text not in lines:
            lines.append(text)
    return acted


def not_reached(plain: dict, zs: dict) -> list[str]:
    """Tests the zeroshim run did not reach because it was stopped (--stop-at)."""
    if not zs.get("stopped"):
        return []
    return [t for t, p in plain["tests"].items() if p["outcome"] != "skipped" and t not in zs["tests"]]


def differing(plain: dict, zs: dict) -> list[str]:
    """Tests whose outcome differs between the two runs (a plainly skipped test not re-run, or one a
    stopped zeroshim run did not reach, does not count)."""
    out = []
    unreached = set(not_reached(plain, zs))
    for test, p in plain["tests"].items():
        z = zs["tests"].get(test)
        if z is None and (p["outcome"] == "skipped" or test in unreached):
            continue
        if z is None or z["outcome"] != p["outcome"]:
            out.append(test)
    return out


def rerun(tests_dir: Path, ids: list[str], out: Path, extra: list[str], rounds: int,
          stop_at: float | None = None, zs_env: dict | None = None) -> dict:
    """Run the differing tests again, ``rounds`` times in each mode, interleaved: a test that also
    fails without zeroshim in some round is DeepSpeed's flaky test, not a zeroshim regression.  No
    round starts after ``stop_at``, and a round it cuts short is dropped (both modes)."""
    history = {t: {"plain": [], "zeroshim": []} for t in ids}
    for i in range(1, rounds + 1):
        if stop_at is not None and time.time() >= stop_at:
            break
        results = {}
        for mode in ("plain", "zeroshim"):
            result = pytest_run(mode, tests_dir, [PROBE, *ids], out, extra, name=f"{mode}.rerun{i}", stop_at=stop_at,
                                zs_env=zs_env)
            if result["stopped"]:
                return history
            results[mode] = result
            if result["tests"].get(PROBE_ID, {}).get("outcome") != "passed":
                die(f"the probe failed in {mode}.rerun{i}; see {out / f'{mode}.rerun{i}.log'}")
        for mode, result in results.items():
            for t in ids:
                history[t][mode].append(result["tests"].get(t, {}).get("outcome", "not run"))
    return history


def compare(plain: dict, zs: dict, history: dict) -> tuple[list, list]:
    """(regressions: passed plainly in every run, not with zeroshim; other differences).  Each entry:
    (test, plain outcomes, zeroshim outcomes, message) with the outcomes of the first run and reruns."""
    regressions, differences = [], []
    unreached = set(not_reached(plain, zs))
    for test in dict.fromkeys([*differing(plain, zs), *history]):
        p, z = plain["tests"][test], zs["tests"].get(test)
        if z is None and test in unreached:
            continue
        p_all = [p["outcome"]] + history.get(test, {}).get("plain", [])
        z_all = [z["outcome"] if z else "not run"] + history.get(test, {}).get("zeroshim", [])
        if len(set(p_all + z_all)) == 1:  # rerun (--only) and the same in every run
            continue
        message = (z or {}).get("message") or p.get("message", "")
        entry = (test, p_all, z_all, message)
        if all(o == "passed" for o in p_all) and any(o != "passed" for o in z_all):
            regressions.append(entry)
        else:
            differences.append(entry)
    return regressions, differences


def counts(result: dict) -> dict:
    out = {}
    for entry in result["tests"].values():
        out[entry["outcome"]] = out.get(entry["outcome"], 0) + 1
    return out


def share(result: dict) -> str:
    """Passed tests as a share of the chosen ones and of those that did not skip (the probe left out)."""
    tests = {t: e for t, e in result["tests"].items() if not t.startswith(PROBE)}
    ran = [e for e in tests.values() if e["outcome"] != "skipped"]
    passed = sum(e["outcome"] == "passed" for e in ran)
    return (f"{passed} of {len(tests)} chosen ({100 * passed / max(len(tests), 1):.0f} %), "
            f"{passed} of {len(ran)} that did not skip ({100 * passed / max(len(ran), 1):.0f} %)")


def report(meta: dict, plain: dict, zs: dict, regressions: list, differences: list, history: dict) -> str:
    def line(c):
        return ", ".join(f"{v} {k}" for k, v in sorted(c.items()))

    lines = [f"# DeepSpeed {meta['release']} unit tests, without and with zeroshim", "",
             f"- tests: DeepSpeed `{meta['ref']}` = {meta['commit'][:12]}"
             + ("" if meta["at_tag"] else f" (NOT the release's tag v{meta['release']})"),
             f"- installed: {meta['versions']}",
             (f"- only: {' '.join(meta['only'])}" if meta["only"] else f"- files: {len(SUBSET)} (tests/dsunit/run.py SUBSET)")
             + f"; pytest args: {' '.join(meta['pytest_args']) or '-'}",
             f"- plain: {line(counts(plain))} in {plain['wall']:.0f} s (pytest exit {plain['exit']}); "
             f"passed {share(plain)}",
             f"- zeroshim ({'every test' if meta['all'] else 'the tests that did not skip plainly'}): "
             f"{line(counts(zs))} in {zs['wall']:.0f} s (pytest exit {zs['exit']})",
             f"- probe: plain ranks without zeroshim, zeroshim ranks with it: {meta['probe']}",
             "- zeroshim runs' flags: " + (" ".join(f"{k}={v}" for k, v in sorted(meta.get("zeroshim_env", {}).items()))
                                            or "none (every patch at its default)"),
             "", f"## Passed without zeroshim in every run, not with it: {len(regressions)}", ""]
    unreached = meta.get("not_reached") or []
    if zs.get("stopped") or meta.get("resumed"):
        lines[8:8] = [f"- the zeroshim run {'was stopped at ' + str(zs.get('stop_at')) if zs.get('stopped') else 'ran to its end'}"
                      f"{' (resumed after the plain run)' if meta.get('resumed') else ''}: {len(unreached)} tests "
                      "that did not skip plainly were not reached (listed at the end; not compared)"]
    def outcomes(runs):
        return "/".join(runs)

    lines += [f"- `{t}`: without {outcomes(p)}, with {outcomes(z)}: {m}" for t, p, z, m in regressions] or ["none"]
    if (regressions or differences) and meta["rounds"] < meta.get("reruns_asked", meta["rounds"]):
        lines += ["", f"(reruns cut short by --stop-at: {meta['rounds']} of {meta['reruns_asked']} done; a "
                      "difference without reruns may be one of DeepSpeed's flaky tests, unconfirmed)"]
    lines += ["", f"## Other differences (first run, then {meta['rounds']} reruns of each): {len(differences)}", ""]
    lines += [f"- `{t}`: without {outcomes(p)}, with {outcomes(z)}: {m}" for t, p, z, m in differences] or ["none"]
    if history:
        def tally(runs):
            return ", ".join(f"{runs.count(o)} {o}" for o in sorted(set(runs)))

        lines += ["", f"## Reruns: outcomes over the first run and {meta['rounds']} reruns, in each mode", ""]
        lines += [f"- `{t}`: without {tally([plain['tests'][t]['outcome'], *h['plain']])}; "
                  f"with {tally([zs['tests'].get(t, {}).get('outcome', 'not run'), *h['zeroshim']])}"
                  for t, h in history.items()]
    failed_both = [(t, e["message"]) for t, e in plain["tests"].items() if e["outcome"] in ("failed", "error")]
    lines += ["", f"## Failing without zeroshim: {len(failed_both)}", ""]
    lines += [f"- `{t}` (with zeroshim: {zs['tests'].get(t, {}).get('outcome', 'not reached' if t in unreached else 'not run')}): {m}"
              for t, m in failed_both] or ["none"]
    skips = {}
    for entry in plain["tests"].values():
        if entry["outcome"] == "skipped":
            reason = re.sub(r"\d+ required, \d+ available", "N required, 2 available", entry["message"])
            skips[reason] = skips.get(reason, 0) + 1
    lines += ["", "## Skipped without zeroshim, by DeepSpeed's reason", ""]
    lines += [f"- {n}: {r}" for r, n in sorted(skips.items(), key=lambda kv: -kv[1])] or ["none"]
    lines += ["", "## CPU adaptations of the tests' references (tests/dsunit/cpu_harness.py), per test", ""]
    for mode, result in (("without zeroshim", plain), ("with zeroshim", zs)):
        per_fix = {}
        for test, names in result.get("harness", {}).items():
            for n in names:
                per_fix.setdefault(n, []).append(test)
        lines.append(f"- {mode}: " + (", ".join(f"{n} in {len(ts)} tests" for n, ts in sorted(per_fix.items()))
                                      or "none acted"))
    per_patch = {}
    for test, msgs in zs["acted"].items():
        for name in {m for msg in msgs for m in re.findall(r"zeroshim\[(\w+)\]", msg)}:
            per_patch.setdefault(name, []).append(test)
    lines += ["", "## zeroshim patches that logged acting (INFO/WARNING), tests per patch", ""]
    lines += [f"- {n}: {len(ts)} tests" for n, ts in sorted(per_patch.items())] or ["none"]
    lines += ["", "## Where zeroshim logged that it acted (INFO/WARNING lines, per test)", ""]
    for test, msgs in sorted(zs["acted"].items()):
        lines.append(f"- `{test}`: " + " | ".join(msgs))
    if not zs["acted"]:
        lines.append("none")
    if unreached:
        lines += ["", f"## Not reached by the stopped zeroshim run: {len(unreached)}", ""]
        lines += [f"- `{t}` (without zeroshim: {plain['tests'][t]['outcome']})" for t in unreached]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--release", required=True, help="the installed DeepSpeed release, e.g. 0.19.2")
    parser.add_argument("--repo", default=os.environ.get("ZEROSHIM_DS_REPO", "https://github.com/deepspeedai/DeepSpeed"),
                        help="DeepSpeed git repository: a local clone/mirror or a URL")
    parser.add_argument("--ref", help="run this ref's tests instead of v<release> (reported as not the release's)")
    parser.add_argument("--out", default="dsunit-results", help="results folder")
    parser.add_argument("--all", action="store_true", help="re-run plainly skipped tests under zeroshim too")
    parser.add_argument("--reruns", type=int, default=3, help="reruns, in each mode, of the tests whose outcome differs")
    parser.add_argument("--resume", action="store_true",
                        help="keep the plain run already in the results folder (plain.json) and do the rest")
    parser.add_argument("--stop-at", metavar="HH:MM",
                        help="stop the zeroshim run and the reruns at this time (local; the next such time, so "
                             "tomorrow's if it has passed today; the report lists the tests not reached)")
    parser.add_argument("--reuse", action="store_true",
                        help="take both full runs from DIR/<release>/results.json of an earlier run; rerun and report")
    parser.add_argument("--only", action="append", metavar="TEST_ID",
                        help="run only these tests (repeatable) and rerun each of them --reruns times, differing or not")
    parser.add_argument("--zeroshim-env", action="append", metavar="ZEROSHIM_FLAG=VALUE", default=[],
                        help="set this zeroshim flag in the zeroshim runs (repeatable), e.g. "
                             "ZEROSHIM_ZERO3_GLOO_GATHER=off to see what one patch does")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --), e.g. -k zero3")
    args = parser.parse_args(argv)
    zs_env = {}
    for item in args.zeroshim_env:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("ZEROSHIM_") or key == "ZEROSHIM_LOG_LEVEL":
            die(f"--zeroshim-env {item!r}: expected ZEROSHIM_<FLAG>=VALUE (a zeroshim flag; the runner sets the "
                "log level itself)")
        zs_env[key] = value

    installed = version("deepspeed")
    if installed != args.release:
        die(f"deepspeed {installed} is installed, not {args.release}")
    ref = args.ref or f"v{args.release}"
    cache = Path(os.environ.get("ZEROSHIM_CACHE", "~/.cache/zeroshim")).expanduser()
    tests_dir, commit = tests_at(ref, args.repo, cache)
    shutil.copyfile(HERE / "probe_zeroshim.py", tests_dir / PROBE)
    out = Path(args.out).resolve() / args.release
    stop_at = None
    if args.stop_at:
        try:
            hour, minute = (int(x) for x in args.stop_at.split(":"))
            if not (0 <= hour < 24 and 0 <= minute < 60):
                raise ValueError
            today = time.localtime()[:3]
            stop_at = time.mktime(today + (hour, minute, 0, 0, 0, -1))
            if stop_at <= time.time():  # already past today: the next such time, tomorrow (as `at` reads it)
                stop_at = time.mktime(today[:2] + (today[2] + 1, hour, minute, 0, 0, 0, -1))
        except ValueError:
            die(f"--stop-at {args.stop_at!r}: expected HH:MM")
        print(f"deepspeed_suite: stopping at {time.strftime('%Y-%m-%d %H:%M', time.localtime(stop_at))} "
              f"(in {(stop_at - time.time()) / 3600:.1f} h)", flush=True)
    if args.reuse and args.resume:
        die("--reuse and --resume exclude each other")
    if args.reuse and zs_env:
        die("--zeroshim-env and --reuse exclude each other (--reuse keeps the earlier zeroshim run)")
    if args.reuse:
        earlier = json.loads((out / "results.json").read_text())
        plain, zs = earlier["plain"], earlier["zeroshim"]
        remove_runs(out, "*.rerun*")  # the reruns are done again
    elif args.resume:
        plain = resumed_plain(out)
        remove_runs(out, "zeroshim*", "*.rerun*", "probe.zeroshim*")
    else:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    prebuild_ops(out)
    if not (args.reuse or args.resume):
        plain = pytest_run("plain", tests_dir, [PROBE, *(args.only or SUBSET)], out, args.pytest_args)
    probe_ok = plain["tests"].get(PROBE_ID, {}).get("outcome")
    if probe_ok != "passed":
        die(f"the probe failed in the plain run ({probe_ok}); see {out / 'plain.log'}")
    if not args.reuse:
        if stop_at is not None and time.time() >= stop_at:
            die(f"--stop-at {args.stop_at} came before the zeroshim run started; the plain run is in {out}: "
                "run again with --resume and a later --stop-at")
        rerun_ids = [t for t, e in plain["tests"].items() if args.all or e["outcome"] != "skipped"]
        rerun_ids = [PROBE] + in_subset_order([t for t in rerun_ids if not t.startswith(PROBE)])
        zs = pytest_run("zeroshim", tests_dir, rerun_ids, out, args.pytest_args, stop_at=stop_at, zs_env=zs_env)
    probe = zs["tests"].get(PROBE_ID, {}).get("outcome")
    if probe is None and zs.get("stopped"):
        die(f"the zeroshim run was stopped (--stop-at) before its probe ran; the plain run is in {out}: "
            "run again with --resume and a later --stop-at")
    if probe != "passed":
        die(f"the probe failed in the zeroshim run ({probe}): zeroshim was not active in DeepSpeed's ranks; "
            f"see {out / 'zeroshim.log'}")
    ranks = []
    for rank in (0, 1):
        seen = json.loads((out / f"probe.zeroshim.{rank}.json").read_text())
        ranks.append(f"rank {rank}: " + ", ".join(sorted(n for n, s in seen["states"].items() if s == "applied")))
    changed = differing(plain, zs)
    if args.only:  # every selected test that ran (and a stopped zeroshim run reached), to count its flips
        unreached = set(not_reached(plain, zs))
        changed = [t for t, e in plain["tests"].items()
                   if e["outcome"] != "skipped" and not t.startswith(PROBE) and t not in unreached]
    history = (rerun(tests_dir, changed, out, args.pytest_args, args.reruns, stop_at, zs_env)
               if changed and len(changed) <= 40 else {})
    regressions, differences = compare(plain, zs, history)
    rounds = min((len(h["plain"]) for h in history.values()), default=0)
    meta = {"release": args.release, "ref": ref, "commit": commit, "at_tag": args.ref is None, "all": args.all,
            "only": args.only or [], "rounds": rounds, "reruns_asked": args.reruns if history else 0,
            "stop_at": zs.get("stop_at"), "resumed": args.resume, "zeroshim_env": zs_env,
            "not_reached": not_reached(plain, zs),
            "pytest_args": args.pytest_args, "probe": "yes; applied in " + "; ".join(ranks),
            "versions": ", ".join(f"{p} {version(p)}" for p in ("torch", "deepspeed", "transformers", "zeroshim"))}
    text = report(meta, plain, zs, regressions, differences, history)
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"meta": meta, "plain": plain, "zeroshim": zs, "reruns": history,
                                                  "regressions": regressions, "differences": differences},
                                                 indent=1, sort_keys=True))
    print(text)
    print(f"deepspeed_suite: results in {out}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
