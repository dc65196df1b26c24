"""Ranks forked from a process that has imported torch and DeepSpeed already (issue #43 item 3, "pay start-up once").

A launch of a scenario starts its ranks as fresh interpreters (:func:`zeroshim._launch.run_ranks`), and each rank
imports torch and DeepSpeed again: 5 to 27 s a launch on the 2-core CI machine, most of it the same work every
time (DeepSpeed 0.19.2 alone imports ``torch._dynamo`` for 5 s).  Here a *pre-fork server* -- one per launcher
process and launch environment -- imports them once; each launch then forks its ranks from it.  Every launch still
gets its own processes (one per rank, each in a session of its own, killed as a whole on a hang or a failure,
nothing shared between launches but the imported modules, copied on write), so a hang, an abort or a patch switched
on stays inside its launch, as with fresh interpreters.

What a forked rank does not repeat is the import of torch and DeepSpeed, so a launch is forked only where that is
all it would have done first (:func:`fork_refusal`):

- the scenario's first top-level statement that is not a plain import, a definition or a docstring is its
  ``import_deepspeed(...)`` call (``zeroshim/scenarios/common.py``); and
- no top-level ``import zeroshim`` comes before it, in the form it takes for this launch's arguments (the arms that
  import zeroshim before torch, to test its post-import hooks, run in a fresh interpreter); and
- the script declares no ``LAUNCH_FRESH = "<why>"`` (isolation by interpreter is the point: a build lock).

Where DeepSpeed imports only with zeroshim's import-compat patches (< 0.14.4), the server imports zeroshim restricted
to them first, as ``import_deepspeed`` does, and the forked rank's ``import_deepspeed`` then reads the rank's own
flags again and sets the restriction it asks for (``ZSLAUNCH_FORKED`` in the rank's environment); a launch whose
flags would change what that import did starts fresh (:func:`import_flags`).  A launch's environment, each rank's
own variables included (``rank_envs``), may differ from the standard one in zeroshim's flags only.  After DeepSpeed
the server also imports what a rank would import at its first engine or model (:data:`EXTRAS`), never a module a
patch targets.

Off unless ``ZSLAUNCH_PREFORK=1`` (noxfile.py sets it for the test sessions); Linux and Python >= 3.11 only (the
server runs with ``-P``: the launcher's working directory, a source checkout, must not shadow the installed
zeroshim).  A server that cannot start, or whose imports leave a second thread behind (forking then is unsafe),
is not used: the launches run as before, and the reason is in the launch's log.
"""

from __future__ import annotations

import ast
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback

#: the environment variable that turns pre-forked launches on
FLAG = "ZSLAUNCH_PREFORK"
#: set in a forked rank's environment: ``import_deepspeed`` reads the rank's flags again and applies its restriction
#: of zeroshim there (inherited by the rank's own subprocesses, as any variable)
FORKED = "ZSLAUNCH_FORKED"
#: variables that change from launch to launch without changing what the imports do (the ranks get them)
VOLATILE = ("PYTEST_CURRENT_TEST", FLAG)
#: how long the server may take to import torch and DeepSpeed (ten times the slowest seen, 27 s)
START_TIMEOUT_S = 300.0


def enabled() -> bool:
    return os.environ.get(FLAG) == "1" and sys.platform.startswith("linux") and sys.version_info >= (3, 11)


# ----------------------------------------------------------------------------------------------------------------
# Which launches may be forked


def _zeroshim_import(node) -> bool:
    if not isinstance(node, (ast.Import, ast.ImportFrom)):
        return False
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return any(n.split(".")[0] == "zeroshim" for n in names)


def _argv_test(test, argv: list) -> "bool | None":
    """``"x" in sys.argv`` and ``or``/``and`` of such tests, evaluated for ``argv``; None for anything else."""
    if isinstance(test, ast.BoolOp):
        values = [_argv_test(v, argv) for v in test.values]
        if None in values:
            return None
        return any(values) if isinstance(test.op, ast.Or) else all(values)
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.In, ast.NotIn))
            and isinstance(test.left, ast.Constant) and isinstance(test.left.value, str)
            and ast.unparse(test.comparators[0]) == "sys.argv"):
        found = test.left.value in argv
        return found if isinstance(test.ops[0], ast.In) else not found
    return None


def _calls_import_deepspeed(node) -> bool:
    value = getattr(node, "value", None)
    return (isinstance(node, (ast.Assign, ast.Expr)) and isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name) and value.func.id == "import_deepspeed")


def fork_refusal(script: str, argv: list) -> "str | None":
    """Why a launch of ``script`` with ``argv`` must start fresh interpreters (None: it may be forked)."""
    try:
        with open(script) as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError) as exc:
        return f"its script could not be read ({exc})"
    fresh = _launch_module().module_constant(tree, "LAUNCH_FRESH")
    if fresh:
        return f"it declares LAUNCH_FRESH: {fresh}"
    for node in tree.body:
        if _calls_import_deepspeed(node):
            return None
        if _zeroshim_import(node):
            return "it imports zeroshim before DeepSpeed"
        if isinstance(node, ast.If) and any(_zeroshim_import(n) for n in ast.walk(node)):
            taken = _argv_test(node.test, argv)
            if taken is None:
                return f"it may import zeroshim before DeepSpeed (line {node.lineno}: a test not read here)"
            if taken:
                return "it imports zeroshim before torch for these arguments"
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(getattr(node, "value", None), ast.Constant)
                and all(isinstance(t, ast.Name) for t in targets)):
            continue  # a module constant
        return f"line {node.lineno} runs before its import_deepspeed() call"
    return "it does not call import_deepspeed() at module level"


# ----------------------------------------------------------------------------------------------------------------
# The server (run as ``python -P -u _prefork.py``)


#: what a rank imports anyway once it builds an engine or a model, where DeepSpeed's own import did not: each
#: ``(module, condition)``, imported after DeepSpeed where ``condition`` (a module) can be found.  DeepSpeed's Muon
#: module (0.18 on) makes every ZeRO engine's optimizer check import torch's compiler: 0.19.2's own import does,
#: 0.19.8's does not, and its ranks then paid 3.5-4.5 s a launch for it on the 2-core CI machine.  transformers:
#: most scenarios build a model with it (0.14.1 and 0.19.2 import it with DeepSpeed, 0.19.8 does not); nothing in
#: DeepSpeed, torch or zeroshim tests whether it is imported.  An extra that fails to import is left out (said in
#: the server's log); one that imports a module a zeroshim patch targets (a forked rank's patches would find it
#: imported where a fresh rank's hook it) makes the server start again without extras (:class:`Server`).
EXTRAS = (("torch._inductor.compile_fx", "deepspeed.runtime.zero.muon"), ("transformers", "transformers"))


def _preimport(targets=(), extras=()) -> list:
    """Import what every rank of a scenario does first: ``common.import_deepspeed()`` (torch, then DeepSpeed, with
    zeroshim restricted to its import-compat patches where DeepSpeed needs them), then ``extras`` (as
    :data:`EXTRAS`); or torch alone where DeepSpeed is not installed.  The helper module itself is dropped again,
    so that each rank imports its own (its start-up clock, its first-call freeze).  ``targets``: the modules
    zeroshim's patches target (:class:`_Refused` where an extra imports one).  Returns what is imported."""
    import importlib
    import importlib.util

    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    try:
        if not has_deepspeed:
            import torch  # noqa: F401
        else:
            import common

            common.import_deepspeed()
    finally:
        sys.modules.pop("common", None)
    imported = [name for name in ("torch", "zeroshim", "deepspeed") if name in sys.modules]
    for name, condition in extras if has_deepspeed else ():
        if name in sys.modules:  # DeepSpeed imported it
            imported.append(name)
            continue
        try:
            if importlib.util.find_spec(condition) is None:
                continue
        except (ImportError, ValueError):
            continue
        before = set(sys.modules)
        try:
            importlib.import_module(name)
        except Exception:  # a rank that needs it fails as it would have: the server goes on without it
            print(f"[prefork] importing {name} failed; left out:", file=sys.stderr)
            traceback.print_exc()
        hit = sorted((set(sys.modules) - before) & set(targets))
        if hit:
            raise _Refused(f"importing {name} imported {', '.join(hit[:4])}, which zeroshim patches: a forked "
                           "rank would find it imported where a fresh one hooks it")
        if name in sys.modules:
            imported.append(name)
    return imported


class _Refused(Exception):
    """An extra imported a module a zeroshim patch targets: this server must not be used; one without extras may."""


def _zeroshim_on() -> list:
    """The patches whose flags changed what the server's import of zeroshim did (where it imported zeroshim):
    those ``common.import_deepspeed`` kept (read, not evaluated: no gate), and those that import left skipped or
    failed for good (a fresh rank with the flag off would say "disabled" instead).  A launch that sets one of
    their flags starts fresh (:func:`import_flags`)."""
    if "zeroshim" not in sys.modules:
        return []
    from zeroshim import _core

    only = _core._overrides["only"]
    kept = set(only if only is not None else _core.patch_names())
    return sorted(kept | {name for name, state in _core._states.items() if state.sticky})


def import_flags(patches) -> set:
    """The variables that change what a server's import of zeroshim did, where the flags of ``patches`` did
    (:func:`_zeroshim_on`): a launch whose ranks set one of them otherwise than the server starts fresh.  The
    others (the flags of every other patch, the log level, the agreement's timeout) a forked rank reads again at
    its first ``import_deepspeed`` (``zeroshim._core.reread_environment``).  What a forked rank does not repeat is
    what the server's zeroshim did at import under the server's environment, which has no flag: with
    ``ZEROSHIM_LOG_LEVEL`` set, the lines a fresh rank logs while DeepSpeed imports (the import-compat patches
    applied, "tested up to") are not logged."""
    return {"ZEROSHIM_DISABLED", "ZEROSHIM_PATCHES", "ZEROSHIM_TIMING"} | {"ZEROSHIM_" + name.upper()
                                                                           for name in patches}


class _Forked:
    """A forked rank, as :func:`zeroshim._launch.supervise` handles a ``subprocess.Popen``."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self):
        while self.poll() is None:
            time.sleep(0.02)
        return self.returncode


def _rank(request: dict, rank: int, channel: int) -> None:
    """In the forked child: become rank ``rank`` of the launch and run its script as ``python -u script`` would;
    never returns."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter (the server ignores it)
        os.close(channel)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["envs"][rank])
        sys.argv = [request["script"], *request["argv"]]
        sys.path.insert(0, os.path.dirname(request["script"]))
        import runpy

        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # what the interpreter does at its exit: wait for non-daemon threads, run the atexit functions
        import threading

        getattr(threading, "_shutdown", lambda: None)()
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _launch_module():
    """``zeroshim._launch`` -- in the server loaded from its file, not through the package: ``import zeroshim``
    applies the patches, and the server must stay as a rank is before its scenario imports zeroshim."""
    if "zeroshim._launch" in sys.modules:
        return sys.modules["zeroshim._launch"]
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_zeroshim_launch", os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["_zeroshim_launch"] = module
    return module


def _serve(request: dict, channel: int) -> int:
    _launch = _launch_module()
    procs = []
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank(request, rank, channel)
        procs.append(_Forked(pid))
    with open(request["log"], "a") as log:
        try:
            return _launch.supervise(procs, request["timeout"], log)
        finally:
            for p in procs:
                if p.poll() is None:
                    _launch._kill_tree(p)
                    p.wait()


def _server() -> None:
    channel = os.dup(1)  # the replies; fd 1 then goes to this server's own log, with fd 2
    os.dup2(2, 1)

    def reply(message: dict) -> None:
        os.write(channel, (json.dumps(message) + "\n").encode())

    started = time.time()
    def arg(name: str) -> list:
        return json.loads(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else []

    try:
        imported = _preimport(arg("--targets"), arg("--extras"))
        zeroshim_on = _zeroshim_on()
    except _Refused as exc:
        reply({"ready": False, "why": str(exc), "retry_without_extras": True})
        return
    except BaseException as exc:
        traceback.print_exc()
        reply({"ready": False, "why": f"importing torch and DeepSpeed failed: {type(exc).__name__}: {exc}"})
        return
    import gc

    gc.freeze()  # as common.freeze_imported: the imported modules are never scanned again, in any rank
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        reply({"ready": False, "why": f"{threads} threads after the imports: forking would copy their locks held"})
        return
    reply({"ready": True, "imported": imported, "zeroshim_on": zeroshim_on,
           "seconds": round(time.time() - started, 2)})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            code = _serve(request, channel)
        except BaseException as exc:
            traceback.print_exc()
            reply({"code": None, "why": f"{type(exc).__name__}: {exc}"})
            continue
        reply({"code": code})


# ----------------------------------------------------------------------------------------------------------------
# The launcher's side


def _patched_modules() -> list:
    """Every module a zeroshim patch targets (optional ones included), from the launcher's zeroshim."""
    from zeroshim import _core

    return sorted({module for name in _core.patch_names() for module in _core._targets(name)[0]})


class Server:
    """One pre-fork server for launches with the environment ``env`` (the ranks' own variables come per launch);
    ``targets``: the modules its imports must not import (default: :func:`_patched_modules`); ``extras``: what it
    imports after DeepSpeed (default :data:`EXTRAS`).  Where an extra imports a target, it starts once more without
    extras (``extras_refused`` says why)."""

    def __init__(self, env: dict, log_path: str, targets: "list | None" = None, extras=None):
        self.why_not, self.seconds, self.imported, self.zeroshim_on, self.extras_refused = None, 0.0, [], [], None
        started = time.time()
        self._log = open(log_path, "a")
        targets = _patched_modules() if targets is None else list(targets)
        first = self._start(env, targets, [list(e) for e in (EXTRAS if extras is None else extras)])
        if first and first.get("retry_without_extras"):
            self.extras_refused = first.get("why")
            self._stop()
            first = self._start(env, targets, [])
        self.seconds = round(time.time() - started, 2)
        self.imported = list((first or {}).get("imported") or [])
        self.zeroshim_on = list((first or {}).get("zeroshim_on") or [])
        if not first or not first.get("ready"):
            self.why_not = (first or {}).get("why") or f"it did not start within {START_TIMEOUT_S:.0f} s"
            self.close()

    def _start(self, env: dict, targets: list, extras: list) -> "dict | None":
        self.proc = subprocess.Popen([sys.executable, "-P", "-u", os.path.abspath(__file__), "--targets",
                                      json.dumps(targets), "--extras", json.dumps(extras)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True)
        return self._read(START_TIMEOUT_S)

    def _stop(self) -> None:
        _launch = _launch_module()
        if self.proc.poll() is None:
            _launch._kill_tree(self.proc)
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def _read(self, timeout: float) -> "dict | None":
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        try:
            return json.loads(line) if line else None
        except ValueError:
            return None

    def alive(self) -> bool:
        return self.why_not is None and self.proc.poll() is None

    def launch(self, script: str, argv: list, envs: list, log_path: str, timeout: float) -> "int | None":
        """Fork the ranks (``envs[r]``: rank r's whole environment) and wait: the launch's code as
        :func:`zeroshim._launch.supervise` gives it; None where the server failed (it is then closed)."""
        request = {"script": script, "argv": [str(a) for a in argv], "envs": envs, "nproc": len(envs),
                   "log": log_path, "timeout": timeout, "cwd": os.getcwd()}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            self.why_not = f"the server is gone ({exc})"
            self.close()
            return None
        answer = self._read(timeout + 60)  # the server enforces ``timeout`` itself; this bounds the server
        if answer is None or answer.get("code") is None:
            self.why_not = (answer or {}).get("why") or "the server did not answer"
            self.close()
            return None
        return answer["code"]

    def close(self) -> None:
        self._stop()
        self._log.close()


_servers: dict = {}


def server_for(env: dict, log_dir: str) -> "Server":
    """This process's server for ``env`` (started on first use; a failed one is not started again)."""
    env = {k: v for k, v in env.items() if k not in VOLATILE}
    key = tuple(sorted(env.items()))
    server = _servers.get(key)
    if server is None:
        if not _servers:
            import atexit

            atexit.register(close_all)
        server = _servers[key] = Server(env, os.path.join(log_dir, f"prefork-{os.getpid()}-{len(_servers)}.log"))
    return server


def close_all() -> None:
    for server in _servers.values():
        if server.why_not is None:
            server.close()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is for the launcher; it closes us
    _server()
