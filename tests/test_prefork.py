"""Ranks forked from a pre-fork server (zeroshim/_prefork.py, issue #43 item 3): which launches may be forked
(read from each script), and what a forked launch is: the same ranks, numbers and failures as fresh
interpreters, each launch in processes of its own."""

import json
import os
import textwrap

import pytest

from harness import ds_before
from zeroshim import _launch, _prefork

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prefork", "probe.py")
# a launch's ranks forked where DeepSpeed imports alone (0.19.8), and where the server imports zeroshim's
# import-compat patches first (0.14.1)
ENVS = ("ds0.14.1", "ds0.19.8")
ENVS_REASON = "the newest stack, and the oldest, whose DeepSpeed imports only with zeroshim's import-compat patches"


def refusal(tmp_path, body: str, argv=()):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(body))
    return _prefork.fork_refusal(str(script), list(argv))


def test_a_script_that_imports_deepspeed_first_is_forked(tmp_path):
    assert refusal(tmp_path, '''
        """doc"""
        import sys
        import torch
        from common import import_deepspeed
        WIDTH = 8
        deepspeed = import_deepspeed(fix_gloo_gathers=True)
        print("anything after")
    ''') is None


@pytest.mark.parametrize("body, argv, expected", [
    ("import zeroshim\nfrom common import import_deepspeed\nimport_deepspeed()\n", (), "imports zeroshim before"),
    ("import sys\nif '--zeroshim' in sys.argv:\n    import zeroshim\nfrom common import import_deepspeed\n"
     "import_deepspeed()\n", ("--zeroshim",), "imports zeroshim before torch for these arguments"),
    ("import os\nif os.environ.get('X'):\n    import zeroshim\nfrom common import import_deepspeed\n"
     "import_deepspeed()\n", (), "a test not read here"),
    ("import os\nos.environ['X'] = '1'\nfrom common import import_deepspeed\nimport_deepspeed()\n", (),
     "line 2 runs before"),
    ("from common import init_distributed\n", (), "does not call import_deepspeed"),
    ("from common import import_deepspeed\nLAUNCH_FRESH = 'a lock'\nimport_deepspeed()\n", (), "LAUNCH_FRESH: a lock"),
])
def test_a_script_that_does_more_first_starts_fresh(tmp_path, body, argv, expected):
    assert expected in refusal(tmp_path, body, argv)


def test_the_argv_test_is_read_for_each_launch(tmp_path):
    body = ("import sys\nif 'with' in sys.argv or 'both' in sys.argv:\n    import zeroshim\n"
            "from common import import_deepspeed\nimport_deepspeed()\n")
    assert refusal(tmp_path, body, ["--mode", "without"]) is None
    assert refusal(tmp_path, body, ["--mode", "with"]) is not None
    assert refusal(tmp_path, body, ["both"]) is not None


def test_the_shipped_scenarios_that_start_fresh_say_why():
    """The isolation cases of issue #43 item 3 keep fresh interpreters: the import-time patches' scenarios (they
    import DeepSpeed their own way), the build lock (declared), the arms that import zeroshim before torch."""
    def why(target, *argv):
        return _prefork.fork_refusal(_launch.scenario(target), list(argv))

    assert "import_deepspeed" in why("torch_elastic_compat") or "runs before" in why("torch_elastic_compat")
    assert why("numpy2_compat") is not None
    assert "LAUNCH_FRESH" in why("stale_build_lock", "--mode", "stale")
    assert why("zero3_generate_sync", "--mode", "with") is not None
    assert why("zero3_generate_sync", "--mode", "without") is None
    assert why("nonreentrant_checkpoint/scenario_trainer.py", "--zeroshim") is not None
    assert why("zero3_dummy_loss") is None


def test_rank_envs_are_refused_where_they_cannot_be_honoured(tmp_path):
    out = str(tmp_path / "never")
    for rank_envs, said in (({2: {"ZEROSHIM_X": "off"}}, "rank 2 is not one of the launch's ranks 0..1"),
                            ({"1": {"ZEROSHIM_X": "off"}}, "rank '1' is not one of"),
                            ({1: {"ZEROSHIM_X": 0}}, "names and values must be strings"),
                            ({1: {"RANK": "0"}}, "RANK is set by the launcher for every rank")):
        with pytest.raises(ValueError, match=said):
            _launch.launch(PROBE, 2, out, rank_envs=rank_envs)
    with pytest.raises(ValueError, match="torchrun gives every rank one environment"):
        _launch.launch(PROBE, 2, out, rank_envs={1: {"ZEROSHIM_X": "off"}}, launcher=[])
    assert not os.path.exists(out)  # refused before anything ran


def test_a_rank_s_own_variable_other_than_a_flag_starts_the_launch_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(_prefork.FLAG, "1")
    out = tmp_path / "other"
    out.mkdir()
    server = _launch._prefork_server(PROBE, 2, {**_launch.clean_env("cpu"), "LOCAL_SIZE": "2"}, [], None, str(out),
                                     {1: {"SOMETHING_ELSE": "1"}})
    assert server is None  # decided before any server is asked for
    assert "its environment is not the standard one (SOMETHING_ELSE)" in (out / "prefork.txt").read_text()


def test_a_server_that_cannot_import_says_why(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "torch.py").write_text("raise ImportError('no torch here')\n")
    env = _launch.clean_env("cpu", PYTHONPATH=str(fake))
    server = _prefork.Server(env, str(tmp_path / "server.log"))
    assert not server.alive()
    assert "importing torch and DeepSpeed failed: ImportError: no torch here" in server.why_not


def _extras_expected() -> set:
    """The extras (``_prefork.EXTRAS``) the server imports in this environment: where the module that calls for it
    exists (found on disk: importing DeepSpeed's subpackage here would import DeepSpeed into the test process)."""
    import importlib.util

    found = set()
    for name, condition in _prefork.EXTRAS:
        top, _, rest = condition.partition(".")
        spec = importlib.util.find_spec(top)
        if spec is None:
            continue
        base = os.path.dirname(spec.origin)
        if not rest or os.path.exists(os.path.join(base, *rest.split("."))) or \
                os.path.exists(os.path.join(base, *rest.split(".")) + ".py"):
            found.add(name)
    return found


@pytest.mark.deepspeed
def test_an_extra_that_imports_a_patched_module_or_fails_leaves_the_server_without_it(tmp_path):
    """An extra that imports a module a patch targets: a forked rank would find that module imported where a fresh
    one hooks it, so the server starts again without extras, and says why; an extra that fails to import is left
    out, said in the server's log.  (Stub modules stand for them.)"""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "zs_stub_target.py").write_text("")
    (stubs / "zs_stub_extra.py").write_text("import zs_stub_target  # noqa: F401\n")
    (stubs / "zs_stub_broken.py").write_text("raise ImportError('broken on purpose')\n")
    env = _launch.clean_env("cpu", LOCAL_SIZE="2")
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(stubs)])
    server = _prefork.Server(env, str(tmp_path / "server.log"), targets=["zs_stub_target"],
                             extras=[("zs_stub_broken", "zs_stub_broken"), ("zs_stub_extra", "zs_stub_extra")])
    try:
        assert server.alive(), server.why_not
        assert "importing zs_stub_extra imported zs_stub_target, which zeroshim patches" in server.extras_refused
        assert not {"zs_stub_extra", "zs_stub_broken"} & set(server.imported), server.imported
        assert "broken on purpose" in (tmp_path / "server.log").read_text()
    finally:
        server.close()


def launch(tmp_path, name, *args, prefork=True, env=None, nproc=2, timeout=600, rank_envs=None):
    before = os.environ.get(_prefork.FLAG)
    os.environ[_prefork.FLAG] = "1" if prefork else "0"
    try:
        return _launch.launch(PROBE, nproc, str(tmp_path / name), *args, env=env, timeout=timeout,
                              rank_envs=rank_envs)
    finally:  # as it was: the test sessions set it for every launch of this worker's later tests
        if before is None:
            os.environ.pop(_prefork.FLAG, None)
        else:
            os.environ[_prefork.FLAG] = before


@pytest.mark.deepspeed
def test_forked_ranks_train_as_fresh_ones_bit_for_bit(tmp_path):
    fresh = launch(tmp_path, "fresh", prefork=False)
    first = launch(tmp_path, "first")
    second = launch(tmp_path, "second")
    assert [r["timing"]["forked"] for r in (fresh, first, second)] == [False, True, True]
    for result in (fresh, first, second):
        assert result["returncode"] == 0, result["log"][-3000:]
    for rank in range(2):
        seen = [r["ranks"][rank] for r in (fresh, first, second)]
        assert seen[0]["losses"] == seen[1]["losses"] == seen[2]["losses"]
        # zeroshim as a fresh rank has it: restricted by the scenario's first import_deepspeed() (here to the
        # import-compat patches where DeepSpeed needs them, and zero3_gloo_gather), not by init_distributed's
        # second call (forked ranks of 0.14.1 lost zero3_gloo_gather there, and their ZeRO-3 runs read unwritten
        # memory now and then)
        assert seen[0]["zeroshim"] == seen[1]["zeroshim"] == seen[2]["zeroshim"]
        assert "zero3_gloo_gather" in seen[0]["zeroshim"], seen[0]["zeroshim"]
        for s in seen:
            assert s["session_leader"] and s["path0"] == os.path.dirname(PROBE)
            assert s["env"]["RANK"] == str(rank) and s["env"]["WORLD_SIZE"] == "2"
            assert s["argv"][0] == "--out"
            assert s["leak"] is None  # nothing of the first launch's ranks shows in the second's
        # the two forked launches came from one server, which is neither a rank nor the test's process
        assert seen[1]["ppid"] == seen[2]["ppid"] != os.getpid()
        assert seen[1]["env"]["ZSLAUNCH_FORKED"] == "1" and seen[0]["env"]["ZSLAUNCH_FORKED"] is None
    assert fresh["ranks"][0]["ppid"] == os.getpid()
    # the server imported, besides torch and DeepSpeed, what a rank imports at its first engine or model (0.19.8's
    # ZeRO engines import torch's compiler: 3.5-4.5 s a launch), and nothing a patch targets (else it would have
    # started again without them)
    for server in [s for s in _prefork._servers.values() if s.alive()]:
        assert server.extras_refused is None and _extras_expected() <= set(server.imported), server.imported


@pytest.mark.deepspeed
def test_zeroshim_flags_reach_forked_ranks_or_start_them_fresh(tmp_path):
    result = launch(tmp_path, "flags", env={**_launch.clean_env("cpu"), "ZEROSHIM_LOG_LEVEL": "INFO",
                                            "LOCAL_SIZE": "2"})
    assert result["returncode"] == 0, result["log"][-3000:]
    assert [r["env"]["ZEROSHIM_LOG_LEVEL"] for r in result["ranks"]] == ["INFO", "INFO"]
    # forked, also where the server imported zeroshim (DeepSpeed < 0.14.4 imports only with its import-compat
    # patches), under an environment without the flag: the rank read its own flags again, as a fresh one does
    assert result["timing"]["forked"] is True
    assert [r["log_level"] for r in result["ranks"]] == ["INFO", "INFO"]
    # a flag exported on one rank only reaches that rank alone, forked or fresh
    for prefork in (True, False):
        one = launch(tmp_path, f"one{prefork}", prefork=prefork, rank_envs={1: {"ZEROSHIM_LOG_LEVEL": "DEBUG"}})
        assert one["returncode"] == 0 and one["timing"]["forked"] is prefork, one["log"][-3000:]
        assert [r["env"]["ZEROSHIM_LOG_LEVEL"] for r in one["ranks"]] == [None, "DEBUG"]
        assert [r["log_level"] for r in one["ranks"]] == ["NOTSET", "DEBUG"]
    # a flag of a patch the server's import of zeroshim applied: its import did what that flag now contradicts
    compat = launch(tmp_path, "compat", env={**_launch.clean_env("cpu"), "ZEROSHIM_NUMPY2_COMPAT": "auto",
                                             "LOCAL_SIZE": "2"})
    assert compat["returncode"] == 0, compat["log"][-3000:]
    assert compat["timing"]["forked"] is not ds_before("0.14.4")
    if ds_before("0.14.4"):
        said = (tmp_path / "compat" / "prefork.txt").read_text()
        assert "flags that change what its server's import of zeroshim did (ZEROSHIM_NUMPY2_COMPAT)" in said
    other = launch(tmp_path, "other", env={**_launch.clean_env("cpu"), "SOMETHING_ELSE": "1", "LOCAL_SIZE": "2"})
    assert other["returncode"] == 0 and other["timing"]["forked"] is False
    said = (tmp_path / "other" / "prefork.txt").read_text()
    assert "its environment is not the standard one (SOMETHING_ELSE)" in said


@pytest.mark.deepspeed
def test_a_failing_rank_stops_the_forked_launch_as_a_fresh_one(tmp_path):
    for prefork in (False, True):
        result = launch(tmp_path, f"fail{prefork}", "--mode", "fail", prefork=prefork, timeout=120)
        assert result["timing"]["forked"] is prefork
        assert result["returncode"] == 1, result["log"][-3000:]
        assert "[launch] rank 1 exited 3; stopping the other ranks" in result["log"]
        for rank in result["ranks"]:
            assert not _alive(rank["pid"])


@pytest.mark.deepspeed
def test_a_hung_forked_launch_is_killed_at_its_bound_and_the_server_serves_on(tmp_path):
    result = launch(tmp_path, "hang", "--mode", "hang", timeout=20)
    assert result["timing"]["forked"] and result["returncode"] == -1
    assert 20 <= result["timing"]["wall"] < 60
    for rank in result["ranks"]:
        assert not _alive(rank["pid"])
    after = launch(tmp_path, "after")
    assert after["returncode"] == 0 and after["timing"]["forked"]
    assert after["ranks"][0]["ppid"] == result["ranks"][0]["ppid"]  # the same server


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.deepspeed
@pytest.mark.skipif(os.environ.get("ZSTEST_ENV") not in (None, "ds0.19.8"),
                    reason="the launcher's port does not depend on the release: runs in ds0.19.8")
def test_a_launch_whose_port_was_taken_runs_again_on_a_new_one(tmp_path, monkeypatch):
    """Between free_port() and the store's bind another process may take the port (CI: EADDRINUSE, with a
    launch of the other xdist worker beside it): the launch runs again, fresh, on a new port."""
    import socket

    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = _launch.free_port
    monkeypatch.setattr(_launch, "free_port", lambda: ports.pop() if ports else real())
    with taken:
        result = launch(tmp_path, "taken")
    assert not ports  # the taken port was handed out
    assert result["returncode"] == 0, result["log"][-3000:]
    assert result["timing"]["forked"] is False  # the second run was a fresh one


def test_free_ports_lie_below_the_kernel_s_ephemeral_range():
    low, _ = _launch.ephemeral_ports()
    ports = {_launch.free_port() for _ in range(20)}
    assert all(_launch.PORTS_FROM <= p < low for p in ports), ports
    assert _launch.port_taken("... port: 42249, useIpv6: false, code: -98, name: EADDRINUSE, message: address ...")
    assert not _launch.port_taken("RuntimeError: has already been reduced")
