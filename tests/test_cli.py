"""zeroshim doctor / explain / zeroshim-run."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import zeroshim
from harness import ONCE_ENV, clean_env, ds_before, master_port
from zeroshim import _cli, _core, _launch, _versions

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DS = _versions.installed("deepspeed")
BIN = Path(sys.executable).parent


# What each patch should do here, written from the evidence (not from the patch declarations).
# What doctor must say of each patch: what its gate (version range + source fingerprint) decides here.
# Whether the gate itself is right in each environment is each patch's own test (tests/test_<name>.py,
# its status test against the range written there independently).
EXPECTED = {name: "would apply" if _core.gate_verdict(zeroshim.get_patch(name))[0] else "skipped"
            for name in zeroshim.patch_names()}


def cli(*args, env=None, stdin=None, cwd=None):
    base = clean_env()
    base.update(env or {})
    exe = shutil.which("zeroshim", path=str(BIN)) or "zeroshim"
    return subprocess.run([exe, *args], env=base, input=stdin, capture_output=True, text=True, cwd=cwd)


# -- doctor ---------------------------------------------------------------------------
def test_doctor_reports_versions_and_verdicts(tmp_path):
    out = cli("doctor", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["versions"]["deepspeed"] == DS
    verdicts = {p["patch"]: p["verdict"] for p in report["patches"]}
    assert set(verdicts) == set(EXPECTED)
    for name, verdict in EXPECTED.items():
        assert verdicts[name] == verdict, (name, report["patches"])
    text = cli("doctor", cwd=tmp_path).stdout
    assert f"deepspeed     {DS}" in text
    for name in zeroshim.patch_names():
        assert name in text


def test_doctor_says_when_the_stack_is_newer_than_the_newest_tested(tmp_path):
    """The matrix's own stack is within what was tested; a torch newer than the newest tested (a
    dist-info directory first on the path, as pip leaves one) is named, with the remedy; the first line
    zeroshim logs at INFO says the same."""
    tested = _versions.NEWEST_TESTED
    out = cli("doctor", "--json", cwd=tmp_path)
    report = json.loads(out.stdout)
    assert report["newest_tested"] == tested
    newer_here = {p: v for p, v, t in _versions.newer_than_tested()}
    assert {e["package"] for e in report["newer_than_tested"]} == set(newer_here)
    assert "deepspeed" not in newer_here  # the matrix's own releases are tested
    fake = tmp_path / "site"
    (fake / "torch-2.99.0.dist-info").mkdir(parents=True)
    env = {"PYTHONPATH": str(fake)}
    text = cli("doctor", env=env, cwd=tmp_path).stdout
    assert f"torch 2.99.0 is newer than the newest tested, {tested['torch']}" in text, text
    assert "run `zeroshim prove`" in text
    log = subprocess.run([sys.executable, "-c", "import zeroshim, torch.utils.checkpoint, deepspeed.runtime.engine"],
                         env={**clean_env(), **env, "ZEROSHIM_LOG_LEVEL": "INFO"}, capture_output=True, text=True,
                         cwd=tmp_path).stderr
    lines = [line for line in log.splitlines() if "zeroshim" in line]
    assert lines and "tested up to torch" in lines[0] and "torch 2.99.0 is newer" in lines[0], log


def test_doctor_names_known_problems_of_the_installed_releases_together(tmp_path):
    """torch >= 2.14 with DeepSpeed < 0.19.5: the C++20 headers against DeepSpeed's -std=c++17; DeepSpeed >= 0.19.6:
    the 10-minute process-group timeout (boundaries written here from the sdists and wheels, not read from
    zeroshim._stack)."""
    from packaging.version import Version

    torch = Version(_versions.base_version(_versions.installed("torch")).base_version)
    cpp17 = torch >= Version("2.14") and Version(DS) < Version("0.19.5")
    report = json.loads(cli("doctor", "--json", cwd=tmp_path).stdout)
    said = [n["problem"] for n in report["stack_notes"]]
    assert any("-std=c++17" in p and "#178150" in p for p in said) == cpp17, said
    short_timeout = Version(DS) >= Version("0.19.6")  # DeepSpeed #8253: default_pg_timeout 30 -> 10 minutes
    assert any("after 10 minutes, not 30" in p for p in said) == short_timeout, said
    chosen = json.loads(cli("doctor", "--json", env={"DEEPSPEED_TIMEOUT": "30"}, cwd=tmp_path).stdout)
    assert not any("after 10 minutes" in n["problem"] for n in chosen["stack_notes"])  # the remedy is applied
    text = cli("doctor", cwd=tmp_path).stdout
    assert ("which no patch fixes" in text) == bool(said)


def test_doctor_names_the_disabling_flag(tmp_path):
    out = cli("doctor", "--json", env={"ZEROSHIM_NONREENTRANT_CHECKPOINT": "off"}, cwd=tmp_path)
    entry = {p["patch"]: p for p in json.loads(out.stdout)["patches"]}["nonreentrant_checkpoint"]
    assert entry["verdict"] == "disabled" and "ZEROSHIM_NONREENTRANT_CHECKPOINT=off" in entry["reason"]


def test_doctor_imports_nothing_heavy(tmp_path):
    code = ("import sys; from zeroshim._cli import main; main(['doctor']); "
            "assert not [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, capture_output=True)


def test_doctor_config_checks(tmp_path):
    risky = {"gradient_clipping": 1.0, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": False}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(risky))
    findings = json.loads(cli("doctor", "--json", "--config", str(path)).stdout)["config"]["findings"]
    patches = {f["patch"] for f in findings}
    assert "nonreentrant_checkpoint" in patches
    assert ("offload_clip_device" in patches) == (EXPECTED["offload_clip_device"] == "would apply")
    assert any("pin_memory" in f["message"] for f in findings)


@pytest.mark.parametrize("zero,needle", [
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param=cpu needs ZeRO stage 3"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs ZeRO stage 1, 2 or 3"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "nvme_path is not set"),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, "without offload_optimizer"),
])
def test_inconsistent_offload_settings(zero, needle):
    messages = [f["message"] for f in _cli.check_config({"zero_optimization": zero})]
    assert any(needle in m for m in messages), messages


def test_a_config_without_gradient_clipping_says_what_deepspeed_does(tmp_path):
    """#44 item 2: without the key, HF Trainer's and accelerate's max_grad_norm never reaches DeepSpeed, which
    clips at its own default: 0 before 0.19.3, 1.0 from it."""
    messages = [f["message"] for f in _cli.check_config({"zero_optimization": {"stage": 2}})]
    said = [m for m in messages if m.startswith("no gradient_clipping")]
    assert len(said) == 1, messages
    assert ("clips gradients at 1.0" in said[0]) == (not ds_before("0.19.3")), said
    assert not [m for m in (f["message"] for f in _cli.check_config({"gradient_clipping": "auto"}))
                if m.startswith("no gradient_clipping")]


@pytest.mark.parametrize("steps,level", [("auto", "warning"), (0, "error"), (10, None)])
def test_a_warmup_scheduler_with_no_warmup_steps(steps, level):
    """#44 item 10: DeepSpeed >= 0.19.3 (not 0.19.6: read in the sdists) refuses warmup_num_steps <= 0, which
    is what HF Trainer puts for "auto" unless warmup is asked for."""
    config = {"gradient_clipping": 1.0,
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": steps, "total_num_steps": 100}}}
    said = [f for f in _cli.check_config(config) if "warmup_num_steps" in f["message"]]
    expected = level if not ds_before("0.19.3") else None
    assert [f["level"] for f in said] == ([expected] if expected else []), said


def test_doctor_exit_status_unreadable_config(tmp_path):
    out = cli("doctor", "--config", str(tmp_path / "missing.json"))
    assert out.returncode == 2 and "could not read it" in out.stdout
    (tmp_path / "broken.json").write_text("{not json")
    assert cli("doctor", "--config", str(tmp_path / "broken.json")).returncode == 2


def test_doctor_exit_status_error_finding_and_clean_config(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}))
    out = cli("doctor", "--config", str(bad))
    assert out.returncode == 1, out.stdout
    assert "ERROR: offload_param=cpu needs ZeRO stage 3" in out.stdout
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}))
    out = cli("doctor", "--config", str(good))
    assert out.returncode == 0 and "nothing risky found" in out.stdout
    report = json.loads(cli("doctor", "--json", "--config", str(bad)).stdout)
    assert report["exit_status"] == 1


@pytest.mark.parametrize("config,needle", [
    ([1, 2], "must be a JSON object, not a JSON list"),
    ({"zero_optimization": [3]}, "zero_optimization must be an object"),
    ({"zero_optimization": {"stage": 3, "offload_param": "cpu"}}, "offload_param must be an object"),
    ({"zero_optimization": {"stage": "three"}}, "stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 5}}, "stage must be 0, 1, 2 or 3"),
    ({"gradient_clipping": "lots"}, "gradient_clipping must be a number"),
])
def test_doctor_refuses_bad_config_shapes_without_a_traceback(tmp_path, config, needle):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    out = cli("doctor", "--config", str(path))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert needle in out.stdout, out.stdout


def test_doctor_reads_numbers_as_deepspeed_does():
    # DeepSpeed's pydantic config accepts "3" for 3: so does doctor
    findings = _cli.check_config({"zero_optimization": {"stage": "3", "offload_param": {"device": "cpu"}}})
    assert not any("needs ZeRO stage 3" in f["message"] for f in findings)
    assert any("without offload_optimizer" in f["message"] for f in findings)


def test_doctor_lists_dependencies(tmp_path):
    report = json.loads(cli("doctor", "--json", cwd=tmp_path).stdout)
    entry = {p["patch"]: p for p in report["patches"]}["nonreentrant_checkpoint"]
    assert "zero3_frozen_recompute" in entry["needs"]
    text = cli("doctor", cwd=tmp_path).stdout
    assert "needs zero3_frozen_recompute for ZeRO-3 and frozen parameters" in text


def test_no_subcommand_is_a_usage_error():
    out = cli()
    assert out.returncode == 2 and "a subcommand is required" in out.stderr


# -- explain --------------------------------------------------------------------------
# Each patch's real logs live in its folder (patches/<name>/logs/, shipped in the wheel): log -> patch.
PATCH_LOGS = {path.name: path for path in sorted(Path(_launch.patches_dir()).glob("*/logs/*.log"))}
LOGS = {name: path.parent.parent.name for name, path in PATCH_LOGS.items()}


def test_every_shipped_log_is_found():
    assert len(LOGS) >= 8 and "zero3_frozen_recompute" in LOGS.values()


@pytest.mark.parametrize("name,patch", sorted(LOGS.items()))
def test_explain_real_logs(name, patch):
    out = cli("explain", "--json", str(PATCH_LOGS[name]))
    assert out.returncode == 0, out.stdout + out.stderr
    found = json.loads(out.stdout)
    assert [f["patch"] for f in found] == [patch]
    text = cli("explain", str(PATCH_LOGS[name])).stdout
    assert text.startswith(patch + ":")
    expected = EXPECTED[patch]
    if expected == "would apply":
        assert "zeroshim would apply it here" in text and "zeroshim-run" in text
    elif "which this bug affects, but zeroshim would not apply it to the versions installed here" in text:
        # the log names the DeepSpeed it came from, one the bug affects: explain says so and where to look
        assert "run `zeroshim doctor` where the log was made" in text
    else:
        assert "would not apply it to the installed versions" in text and "has another cause" in text


# Messages that look like a patch's but lack what makes them that bug.
LOOK_ALIKES = {
    "offload_clip_device": (
        "Traceback (most recent call last):\n  File \"train.py\", line 9, in forward\n"
        "    return self.proj(x)\n  File \"/venv/site-packages/torch/nn/modules/linear.py\", line 125, in forward\n"
        "    return F.linear(input, self.weight, self.bias)\nRuntimeError: Expected all tensors to be on the same "
        "device, but found at least two devices, cuda:0 and cpu! (when checking argument for argument mat1)\n"),
    "zero3_frozen_recompute": (
        "torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the following "
        "tensors have different metadata than during the forward pass.\ntensor at position 3:\n"
        "saved metadata: {'shape': torch.Size([4, 8]), 'dtype': torch.float32, 'device': device(type='cpu')}\n"
        "recomputed metadata: {'shape': torch.Size([8, 4]), 'dtype': torch.float32, 'device': device(type='cpu')}\n"),
    "zero3_dummy_loss": (
        "RuntimeError: Function MulBackward0 returned an invalid gradient at index 0 - got [3, 4] but expected "
        "shape compatible with [4, 3]\n"),
    "numpy2_compat": (
        "  File \"/venv/site-packages/someplotlib/io.py\", line 3, in <module>\n"
        "ImportError: cannot import name 'BUFSIZE' from 'numpy' (/venv/site-packages/numpy/__init__.py)\n"),
}


@pytest.mark.parametrize("patch", sorted(LOOK_ALIKES))
def test_explain_does_not_blame_look_alikes(patch):
    out = cli("explain", "--json", "-", stdin=LOOK_ALIKES[patch])
    assert out.returncode == 1, out.stdout
    assert json.loads(out.stdout) == []


def test_explain_says_not_this_bug_when_the_log_shows_an_unaffected_deepspeed():
    log = (PATCH_LOGS["frozen_recompute_ds0.19.2_2ranks.log"]).read_text()
    unaffected = "[INFO] [logging.py:107:log_dist] [Rank 0] DeepSpeed info: version=0.19.8, git-hash=unknown\n" + log
    out = cli("explain", "-", stdin=unaffected)
    assert out.returncode == 0
    assert "not this bug: the log comes from DeepSpeed 0.19.8" in out.stdout
    assert "=on" not in out.stdout
    affected = log.replace("[rank0]", "[INFO] DeepSpeed info: version=0.19.2, git-hash=x\n[rank0]", 1)
    text = cli("explain", "-", stdin=affected).stdout
    assert "not this bug" not in text


def test_explain_never_advises_forcing_a_patch_on():
    for name in LOGS:
        assert "=on" not in cli("explain", str(PATCH_LOGS[name])).stdout


def test_explain_unrelated_log():
    out = cli("explain", str(FIXTURES / "unrelated_shape_error_2ranks.log"))
    assert out.returncode == 1
    assert "No known zeroshim error signature" in out.stdout


def test_explain_reads_stdin_and_strips_rank_prefixes():
    log = ("[rank1]: AssertionError: The parameter 7 has already been reduced.\n"
           "[rank1]:                     Gradient computed twice for this partition.\n")
    out = cli("explain", "-", stdin=log)
    assert out.returncode == 0 and out.stdout.startswith("nonreentrant_checkpoint:")


def test_explain_says_how_to_enable_a_disabled_patch():
    out = cli("explain", str(PATCH_LOGS["zero2_already_reduced_ds0.19.8_2ranks.log"]),
              env={"ZEROSHIM_DISABLED": "1"})
    assert "set ZEROSHIM_NONREENTRANT_CHECKPOINT=auto" in out.stdout


# -- zeroshim-run ---------------------------------------------------------------------
def test_launcher_keeps_an_existing_sitecustomize_and_pythonpath(tmp_path):
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    code = ("import os, sys; print(os.environ.get('USER_SITECUSTOMIZE_RAN'), 'zeroshim' in sys.modules, "
            "'torch' in sys.modules)")
    env = clean_env(PYTHONPATH=str(custom))
    run = shutil.which("zeroshim-run", path=str(BIN))
    out = subprocess.run([run, sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True", "False"]
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert plain.stdout.split() == ["1", "False", "False"]


def test_launcher_environment():
    env = _cli.launcher_env({"PYTHONPATH": "/a:/b", "ZEROSHIM_DISABLED": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [_cli.BOOTSTRAP_DIR, "/a", "/b"]
    assert env["ZEROSHIM_DISABLED"] == "1"  # flags pass through
    assert _cli.launcher_env(env)["PYTHONPATH"] == env["PYTHONPATH"]  # no double entry


# The launcher's bootstrap does not depend on the DeepSpeed release; the oldest one is also where its worker
# needs torch_elastic_compat to import at all.
TORCHRUN_ENVS = ("ds0.14.1", ONCE_ENV)


@pytest.mark.deepspeed
@pytest.mark.skipif(os.environ.get("ZSTEST_ENV") not in (None, *TORCHRUN_ENVS),
                    reason=f"the launcher does not depend on the DeepSpeed release: runs in {', '.join(TORCHRUN_ENVS)}")
def test_launcher_activates_every_rank_of_torchrun(tmp_path):
    """The checkpointing demo's worker has no `import zeroshim`: fails on 2 ranks
    without the launcher, trains with it."""
    def torchrun(prefix):
        env = clean_env(LOCAL_SIZE="2")
        if ds_before("0.14.4"):  # that DeepSpeed cannot even be imported without zeroshim
            env["ZEROSHIM_PATCHES"] = "torch_elastic_compat,nonreentrant_checkpoint"
        for _ in range(2):  # again on a new port where another launch beside this one took it first
            with master_port() as port:
                cmd = prefix + [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                "--master_addr", "127.0.0.1", "--master_port", str(port),
                                str(EXAMPLES / "checkpoint_demo.py"), "--worker", "--stage", "2", "--steps", "2"]
                code, out, err = _launch.run_group(cmd, env=env, timeout=600, cwd=tmp_path)  # ranks die with a timeout
            if not _launch.port_taken(out + err):
                break
        return subprocess.CompletedProcess(cmd, code, out, err)

    without = torchrun([])
    if not ds_before("0.14.4"):
        assert without.returncode != 0
        assert "has already been reduced" in without.stdout + without.stderr
    else:
        assert "cannot import name '_get_socket_with_port'" in without.stdout + without.stderr
    with_ = torchrun([shutil.which("zeroshim-run", path=str(BIN))])
    assert with_.returncode == 0, (with_.stdout + with_.stderr)[-4000:]
    assert "RESULT trained 2 steps" in with_.stdout


@pytest.mark.parametrize("name", sorted(n for n in zeroshim.patch_names() if zeroshim.get_patch(n).fingerprint))
def test_source_fingerprints_agree_with_the_version_gates_here(name):
    """In every pinned environment the installed DeepSpeed's source and its
    version number must give the same verdict (the ranges were read from the
    same sources); a disagreement means a range or a fingerprint is wrong."""
    from zeroshim import _core

    verdict, reason = _core.gate_verdict(zeroshim.get_patch(name))
    assert "the source agrees" in reason, reason
    assert verdict == (EXPECTED[name] == "would apply")


def test_a_launch_past_its_timeout_takes_its_ranks_down(tmp_path):
    """_launch.run_group kills the whole process group at the timeout: a rank left behind (in a collective
    whose peer died) would otherwise spin on the CPU after the launcher is gone."""
    import time

    pid_file = tmp_path / "child.pid"
    # the child in a session of its own, as torchrun starts its ranks (so the launcher's group does not
    # reach it), holding the output pipe
    code, out, _ = _launch.run_group(["bash", "-c", f"setsid sleep 300 & echo $! > {pid_file}; echo started; wait"],
                                     timeout=2, merge=True)
    assert code == -1 and "started" in out
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is asynchronous: give the kernel a moment to reap
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the launch's child {child} outlived the timeout")


@pytest.mark.parametrize("deepspeed, config, said", [
    ("0.19.3", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, True),
    ("0.19.8", {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 1}}, True),
    ("0.19.8", {"bfloat16": {"enabled": "true"}, "zero_optimization": {"stage": "2"}}, True),
    ("0.19.2", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, True),
    ("0.16.9", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, True),
    ("0.19.2", {"bf16": {"enabled": True, "check_grad_overflow": False}, "zero_optimization": {"stage": 2}}, False),
    ("0.19.8", {"bf16": {"enabled": True, "check_grad_overflow": True}, "zero_optimization": {"stage": 2}}, False),
    ("0.19.8", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}, False),
    ("0.19.8", {"bf16": {"enabled": 1}, "zero_optimization": {"stage": 2}}, True),
    ("0.19.8", {"bf16": None, "bfloat16": {"enabled": "yes"}, "zero_optimization": {"stage": 2}}, True),
    # ZeRO-1 accumulating in fp32 runs BF16_Optimizer, which skips such steps whatever the key says
    ("0.19.8", {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                "zero_optimization": {"stage": 1}}, False),
    ("0.19.8", {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, True),
    ("0.19.8", {"bf16": {"enabled": False}, "zero_optimization": {"stage": 2}}, False),
    ("0.19.8", {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, False),
    (None, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, False)])
def test_bf16_steps_skipped_on_overflow_from_0_19_3(deepspeed, config, said):
    """#44 item 2: DeepSpeed 0.19.3 turned bf16.check_grad_overflow on by default (False in the 0.19.2 sdist, True
    in 0.19.3 and 0.19.8; ZeRO-1/2's optimizer reads it, ZeRO-3 checks fp16 only): a step with an inf gradient is
    skipped, where 0.19.2 applied it and the weights became NaN (both run: RESULTS); before 0.19.3 the note says
    so.  The boundaries are written here."""
    from zeroshim import _dsconfig

    found = [f for f in _dsconfig.general_findings(_dsconfig.read(config)[0], deepspeed)
             if "check_grad_overflow" in f["message"]]
    assert bool(found) == said, found
    from packaging.version import Version

    if said and Version(deepspeed) < Version("0.19.3"):
        # before 0.19.3 the step is applied: the weights become NaN; the setting exists from 0.17.1
        message = found[0]["message"]
        assert found[0]["level"] == "warning" and f"DeepSpeed {deepspeed} does not check bf16 gradients" in message \
            and "nonfinite_grad_step" in message, message
        assert ("Write \"check_grad_overflow\": true" in message) == (Version(deepspeed) >= Version("0.17.1")), message
    elif said:
        assert found[0]["level"] == "warning" and f"DeepSpeed {deepspeed} skips every optimizer step" in \
            found[0]["message"] and "OVERFLOW! Skipping step" in found[0]["message"]
        # 0.19.3-0.19.7 skip without a word (the static loss scaler's update_scale is `pass`; 0.19.8 logs)
        assert ("without a word" in found[0]["message"]) == (deepspeed != "0.19.8"), found[0]["message"]


@pytest.mark.parametrize("deepspeed, config, said", [
    ("0.18.2", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                "data_types": {"grad_accum_dtype": "fp32"}}, True),
    ("0.18.4", {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 0},
                "data_types": {"grad_accum_dtype": "fp32"}}, True),
    ("0.17.6", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                "data_types": {"grad_accum_dtype": "fp32"}}, True),
    ("0.18.5", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                "data_types": {"grad_accum_dtype": "fp32"}}, False),  # builds BF16_Optimizer
    ("0.17.5", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                "data_types": {"grad_accum_dtype": "fp32"}}, False),
    ("0.18.2", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                "data_types": {"grad_accum_dtype": "fp32"}}, False),  # the ZeRO optimizer
    ("0.18.2", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, False),  # no fp32 accumulation
    ("0.18.2", {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, False)])
def test_bf16_optimizer_asked_for_where_deepspeed_never_builds_it(deepspeed, config, said):
    """DeepSpeed 0.17.6-0.18.4: BFLOAT16 == DDP_BFLOAT16 ("bf16"), so bf16 with fp32 accumulation at stage 0 or 1 gets
    the fp16 wrapper (run on 0.18.2 and 0.18.4: FP16_UnfusedOptimizer, trained as stage 0; 0.18.5 builds
    BF16_Optimizer; RESULTS 63).  The boundary is written here."""
    from zeroshim import _dsconfig

    found = [f for f in _dsconfig.general_findings(_dsconfig.read(config)[0], deepspeed)
             if "not the BF16_Optimizer" in f["message"]]
    assert bool(found) == said, found
    if said:
        assert found[0]["level"] == "warning" and "Remedy: DeepSpeed >= 0.18.5" in found[0]["message"]
        assert ("partitions no optimizer state" in found[0]["message"]) == ("'stage': 1" in str(config))


@pytest.mark.parametrize("deepspeed, config, said", [
    ("0.19.8", {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}, True),
    ("0.19.8", {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-4, "total_num_steps": 9}}}, True),
    ("0.19.8", {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9}}}, True),  # its 0.001
    ("0.16.9", {"scheduler": {"type": "WarmupLR", "params": {}}}, True),  # 0.001 for every group before 0.17.2
    ("0.19.8", {"scheduler": {"type": "WarmupLR", "params": {}}}, False),  # each group's own rate from 0.19.4
    ("0.18.9", {"scheduler": {"type": "WarmupLR"}}, False),  # group 0's rate: patch warmup_lr_groups
    ("0.19.8", {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [1e-4, 1.6e-3]}}}, False),
    ("0.19.8", {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1}}},
     False),
    ("0.19.8", {"optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-4}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.02}}}, True),
    ("0.19.8", {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2}}}, False),
    ("0.19.8", {"scheduler": ["WarmupLR"]}, False),
    ("0.19.8", {"scheduler": {"type": "WarmupLR", "params": "auto"}}, False)])
def test_a_warmup_scheduler_with_one_peak_rate_for_several_groups(deepspeed, config, said):
    """WarmupLR/WarmupDecayLR repeat one warmup_max_lr for every param group (_format_param; the HF Trainer fills
    "auto" with its learning rate; WarmupDecayLR's default is 0.001, WarmupLR's before 0.17.2): over the caller's
    or the Trainer's optimizer (no optimizer section), whose groups may have their own rates (LoRA+, per-module
    rates), or Muon's two groups.  Run (RESULTS 59): groups built at 1e-4 and 1.6e-3 end at 1e-4 and 1e-4 on
    DeepSpeed 0.19.2 and 0.19.8, and WarmupCosineLR keeps both."""
    from zeroshim import _dsconfig

    found = [f for f in _dsconfig.general_findings(_dsconfig.read(config)[0], deepspeed)
             if "warms every param group" in f["message"]]
    assert bool(found) == said, found
    if said:
        assert found[0]["level"] == "warning" and "write warmup_max_lr as a list" in found[0]["message"]


def test_doctor_reads_the_installed_deepspeed_for_the_muon_check(tmp_path):
    """#44 item 10: DeepSpeed has Muon from 0.17.6 and reads muon_lr/adam_lr from 0.18.3 (read in the sdists); the
    check is patch muon_group_lr's (tests/test_muon_group_lr.py), read here through doctor on this DeepSpeed."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "Muon", "params": {"lr": 0.02, "muon_lr": 0.02,
                                                                          "adam_lr": 3e-4}}}))
    findings = json.loads(cli("doctor", "--json", "--config", str(path), cwd=tmp_path).stdout)["config"]["findings"]
    in_range = not ds_before("0.17.6") and ds_before("0.18.3")
    said = [f for f in findings if "muon_lr and adam_lr" in f["message"]]
    assert bool(said) == in_range, findings
    assert all(f["patch"] == "muon_group_lr" and "zeroshim patch muon_group_lr covers this" in f["message"]
               for f in said), said
