"""Flags and activation on every node (issue #14 item 7).

DeepSpeed's multi-node runner (``deepspeed --hostfile``) forwards only
variables with some prefixes to remote nodes (``PYTHON``, ``MLFLOW``, ``MV2``,
``UCX``, the accelerator's, and ``.deepspeed_env``), so ``ZEROSHIM_*`` flags
set on the launching node never reach the others.  ``zeroshim-run`` carries
them in ``PYTHON_ZEROSHIM_ENV``.

The runner is the real one.  Remote nodes are simulated: a fake ``pdsh``
first on PATH runs the command DeepSpeed hands it once per host, the way sshd
would, in a clean ``env -i`` shell, so a "remote" rank sees exactly what the
runner forwards and nothing of the launching shell; other backends' commands
are recorded and checked.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import clean_env, free_port
from zeroshim import _cli, _flags

# The runner's launches run in the oldest and the newest release of the matrix (CI time, issue #28): the
# environment forwarding they exercise (`.deepspeed_env`, the exported prefixes) is the same code in between.
ENVS = ("ds0.14.1", "ds0.19.8")
ENVS_REASON = "the oldest and the newest release bracket the runner's forwarding code"
BIN = Path(sys.executable).parent
FLAGS = {"ZEROSHIM_PATCHES": "torch_elastic_compat,nonreentrant_checkpoint,zero3_dummy_loss",
         "ZEROSHIM_ZERO3_DUMMY_LOSS": "off"}

FAKE_BACKEND = r'''#!{python}
"""Fake {tool}: records argv; as pdsh, runs the remote command per host in a clean environment."""
import json, os, subprocess, sys
record = {record!r}
with open(os.path.join(record, "{tool}-%d.json" % os.getpid()), "w") as fh:
    json.dump(sys.argv, fh)
if "{tool}" == "ssh":
    sys.exit(255)  # the runner must not need ssh here
if "{tool}" == "pdsh":
    args, hosts, i = sys.argv[1:], [], 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] in ("-w", "-f", "-R", "-l", "-u", "-t"):
            hosts = args[i + 1].split(",") if args[i] == "-w" else hosts
            i += 2
        else:
            i += 1
    command = " ".join(args[i:])
    for n, host in enumerate(hosts):
        env = {{"HOME": os.environ["HOME"], "PATH": "/usr/bin:/bin", "FAKE_HOST": host, "FAKE_RECORD": record}}
        rc = subprocess.run(["bash", "-c", command.replace("%n", str(n))], env=env).returncode
        if rc:
            sys.exit(rc)
'''

REPORT = r'''
import json, os, sys
out = {"host": os.environ.get("FAKE_HOST"), "zeroshim_imported": "zeroshim" in sys.modules,
       "zeroshim_env": {k: v for k, v in os.environ.items() if k.startswith("ZEROSHIM_")}}
if out["zeroshim_imported"]:
    import zeroshim
    out["status"] = {k: [v.state, v.reason] for k, v in zeroshim.status().items()}
with open(os.path.join(os.environ["FAKE_RECORD"], "rank-%s.json" % out["host"]), "w") as fh:
    json.dump(out, fh)
'''


def fake_cluster(tmp_path):
    bindir, record, home, work = (tmp_path / d for d in ("bin", "record", "home", "work"))
    for d in (bindir, record, home, work):
        d.mkdir()
    for tool in ("pdsh", "sinfo", "srun", "ssh"):
        path = bindir / tool
        path.write_text(FAKE_BACKEND.format(python=sys.executable, record=str(record), tool=tool))
        path.chmod(0o755)
    (work / "hostfile").write_text("fakehost-a slots=1\nfakehost-b slots=1\n")
    (work / "report.py").write_text(REPORT)
    return bindir, record, home, work


def launch(tmp_path, launcher, prefix, extra_env=None):
    bindir, record, home, work = fake_cluster(tmp_path)
    env = clean_env(HOME=str(home), PYTHONDONTWRITEBYTECODE="1", **FLAGS)
    env["PATH"] = os.pathsep.join([str(bindir), str(BIN), env.get("PATH", "")])
    env.pop("PYTHONPATH", None)  # the harness's scenario directory
    env.update(extra_env or {})
    cmd = prefix + [str(BIN / "deepspeed"), "--hostfile", "hostfile", "--no_ssh_check",
                    "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--launcher", launcher,
                    "report.py"]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    ranks = {p.name: json.loads(p.read_text()) for p in record.glob("rank-*.json")}
    calls = {p.name.split("-")[0]: json.loads(p.read_text()) for p in record.glob("*.json")
             if not p.name.startswith("rank-")}
    return proc, ranks, calls


@pytest.mark.deepspeed
def test_zeroshim_run_flags_reach_every_node_of_deepspeeds_pdsh_runner(tmp_path):
    proc, ranks, calls = launch(tmp_path, "pdsh", [shutil.which("zeroshim-run", path=str(BIN))])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "ssh" not in calls
    assert sorted(ranks) == ["rank-fakehost-a.json", "rank-fakehost-b.json"]
    for rank in ranks.values():
        assert rank["zeroshim_imported"], rank
        status = rank["status"]
        assert status["zero3_dummy_loss"][0] == "disabled"
        assert "ZEROSHIM_ZERO3_DUMMY_LOSS=off" in status["zero3_dummy_loss"][1]
        assert status["epoch_boundary"] == ["disabled", "disabled: not in ZEROSHIM_PATCHES"]
        assert status["nonreentrant_checkpoint"][0] in ("pending", "applied")


@pytest.mark.deepspeed
def test_without_the_carrier_remote_nodes_lose_the_flags(tmp_path):
    """The problem the carrier solves, shown on the same fake cluster: zeroshim
    active on the remote ranks (bootstrap on the forwarded PYTHONPATH) but the
    ZEROSHIM_* flags of the launch are not there."""
    extra = {"PYTHONPATH": _cli.BOOTSTRAP_DIR}
    proc, ranks, _ = launch(tmp_path, "pdsh", [], extra)
    if proc.returncode != 0 and "_get_socket_with_port" in proc.stdout + proc.stderr:
        pytest.skip("this DeepSpeed's runner needs zeroshim's import shims, which the allow-list of this run keeps")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for rank in ranks.values():
        assert rank["zeroshim_imported"] and rank["zeroshim_env"] == {}
        assert rank["status"]["zero3_dummy_loss"][0] != "disabled"


@pytest.mark.deepspeed
def test_carrier_is_in_the_slurm_backends_command(tmp_path):
    proc, _, calls = launch(tmp_path, "slurm", [shutil.which("zeroshim-run", path=str(BIN))])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    argv = " ".join(calls["srun"])
    assert f"{_flags.CARRIER}=" in argv
    carried = argv.split(f"{_flags.CARRIER}=", 1)[1].split(",")[0].split()[0]
    assert _flags.decode_flags(carried) == {**FLAGS, "ZEROSHIM_RUN": "1"}


# -- the carrier itself ----------------------------------------------------------------
def test_carrier_round_trip_and_it_wins_over_stale_values():
    env = _cli.launcher_env({"ZEROSHIM_PATCHES": "a,b", "ZEROSHIM_X": "odd value; with=signs", "PATH": "/bin"})
    value = env[_flags.CARRIER]
    assert set(value) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert _flags.decode_flags(value) == {"ZEROSHIM_PATCHES": "a,b", "ZEROSHIM_X": "odd value; with=signs",
                                          "ZEROSHIM_RUN": "1"}
    assert _flags.decode_flags(f'"{value}"') == _flags.decode_flags(value)  # quotes left by MPI backends
    remote = {_flags.CARRIER: value, "ZEROSHIM_DISABLED": "1", "ZEROSHIM_STALE": "x"}  # e.g. an old .deepspeed_env
    effective = _flags.effective_environ(remote)
    assert "ZEROSHIM_DISABLED" not in effective and "ZEROSHIM_STALE" not in effective
    assert effective["ZEROSHIM_PATCHES"] == "a,b"


def test_unreadable_carrier_is_ignored_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="zeroshim"):
        effective = _flags.effective_environ({_flags.CARRIER: "%%%", "ZEROSHIM_DISABLED": "1"})
    assert effective["ZEROSHIM_DISABLED"] == "1"
    assert "PYTHON_ZEROSHIM_ENV cannot be read" in caplog.text


def test_carried_flags_decide_at_import(tmp_path):
    carried = _flags.encode_flags({"ZEROSHIM_DISABLED": "1"})
    env = {"PATH": "/usr/bin:/bin", _flags.CARRIER: carried}
    code = "import zeroshim; print(zeroshim.status()['nonreentrant_checkpoint'].reason)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.strip() == "disabled by ZEROSHIM_DISABLED=1", out.stderr
    assert textwrap.dedent(out.stderr).strip() == ""
