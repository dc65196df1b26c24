"""``zeroshim prove``: a real proof end to end, and the command's verdicts."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import clean_env
from zeroshim import _prove

BIN = Path(sys.executable).parent


@pytest.mark.deepspeed
@pytest.mark.once  # the command's machinery; each patch's reproduction runs in every environment in its own tests
def test_prove_one_patch_for_real(tmp_path):
    """nonreentrant_checkpoint applies to every release: its reproduction must
    fail without zeroshim and match the reference with it, on this machine."""
    exe = shutil.which("zeroshim", path=str(BIN))
    # as on a GPU machine: a visible device must not pull the CPU forms onto CUDA (here there is none)
    out = subprocess.run([exe, "prove", "--patches", "nonreentrant_checkpoint", "--json", "--keep", str(tmp_path)],
                         env=clean_env(CUDA_VISIBLE_DEVICES="0"), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [row] = [r for r in json.loads(out.stdout)["rows"] if r["patch"] == "nonreentrant_checkpoint"]
    assert row["proven"] is True
    assert "has already been reduced" in row["without"] and "bit for bit" in row["with"]
    assert (tmp_path / "nonreentrant_checkpoint" / "log.txt").exists()


def args(**kw):
    base = {"patches": None, "nproc": 2, "device": "cpu", "keep": None, "json": True}
    base.update(kw)
    return argparse.Namespace(**base)


class _Stub:
    """A proof module stand-in: ``prove`` returns or raises what the test gives it."""

    def __init__(self, prove):
        self.prove = prove


def stub(monkeypatch, name, prove):
    real = _prove.proof
    monkeypatch.setattr(_prove, "proof", lambda n: _Stub(prove) if n == name else real(n))


def test_a_patch_that_does_not_prove_itself_fails_the_command(monkeypatch, capsys, tmp_path):
    stub(monkeypatch, "zero3_dummy_loss", lambda launch, out, nproc, device: ("trained", "trained", False))
    assert _prove.main(args(patches="zero3_dummy_loss", keep=str(tmp_path))) == 1
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["proven"] is False


def test_a_launch_that_cannot_run_is_not_proven(monkeypatch, capsys, tmp_path):
    def broken(launch, out, nproc, device):
        raise _prove.Unproven("the launch exited 1")

    stub(monkeypatch, "zero3_dummy_loss", broken)
    assert _prove.main(args(patches="zero3_dummy_loss", keep=str(tmp_path))) == 1
    assert "could not run: the launch exited 1" in capsys.readouterr().out


# What torchrun prints when rank 1 fails: the rank's own error, then the launcher's traceback.
TORCHRUN_LOG = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 8, in <module>
[rank1]:     engine.backward(loss)
[rank1]: RuntimeError: shape '[4, 8]' is invalid for input of size 0
E1125 08:00:00.000000 123 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1)
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
  File "/venv/site-packages/torch/distributed/run.py", line 936, in run
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_a_failed_launch_reports_the_failing_rank_s_root_cause_and_keeps_its_log():
    result = {"returncode": 1, "log": TORCHRUN_LOG, "ranks": [{"ok": True}, None], "log_path": "/tmp/x/log.txt"}
    with pytest.raises(_prove.Unproven) as info:
        _prove.ranks_of(result)
    text = str(info.value)
    assert "RuntimeError: shape '[4, 8]' is invalid for input of size 0" in text
    assert "ChildFailedError" not in text and "rank(s) 1 wrote no result" in text and "/tmp/x/log.txt" in text


def test_an_abort_at_exit_after_every_rank_wrote_its_results_is_judged_by_the_results():
    log = "training done\nterminate called without an active exception\n"
    result = {"returncode": -6, "log": log, "ranks": [{"ok": True}, {"ok": True}]}
    assert _prove.ranks_of(result) == [{"ok": True}, {"ok": True}]


def test_a_failure_without_zeroshim_that_is_not_this_bug_proves_nothing():
    ok = {"ok": True, "losses": [1.0], "param_sha256": "x"}
    ranks = [{"without": {"ok": False, "error": "RuntimeError: out of memory @ frames"}, "with": ok, "reference": ok}]
    said_without, _, proven = _prove.failed_vs_equal(ranks, "without", "with", "reference",
                                                     patch="nonreentrant_checkpoint")
    assert proven is False and said_without.startswith("failed with another error (not this bug)")
    ranks[0]["without"]["error"] = ("AssertionError: The parameter 3 has already been reduced. Gradient computed twice "
                                   "for this partition. @ frames")
    assert _prove.failed_vs_equal(ranks, "without", "with", "reference", patch="nonreentrant_checkpoint")[2]


def test_unknown_patch_is_a_usage_error(capsys):
    assert _prove.main(args(patches="no_such_patch")) == 2
    assert "valid:" in capsys.readouterr().err


def test_every_patch_has_a_proof():
    import zeroshim

    assert all(_prove.proof(name) is not None for name in zeroshim.patch_names())


def test_a_reproduction_that_cannot_show_the_bug_here_is_not_run_not_failed(monkeypatch, capsys, tmp_path):
    def needs_gpu(launch, out, nproc, device):
        raise _prove.NotHere("needs a CUDA device")

    stub(monkeypatch, "zero3_dummy_loss", needs_gpu)
    assert _prove.main(args(patches="zero3_dummy_loss", keep=str(tmp_path))) == 0
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["proven"] is None and row["without"] == "not run here: needs a CUDA device"


def test_cpu_forms_force_deepspeed_s_cpu_accelerator_and_hide_gpus(monkeypatch):
    from zeroshim import _launch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    cpu = _launch.clean_env(_launch.device_of(("--stages", "2,3")))
    assert cpu["DS_ACCELERATOR"] == "cpu" and cpu["CUDA_VISIBLE_DEVICES"] == ""
    cuda = _launch.clean_env(_launch.device_of(("--device", "cuda")))
    assert cuda["DS_ACCELERATOR"] == "cuda" and cuda["CUDA_VISIBLE_DEVICES"] == "0"  # the GPU form: untouched


def test_a_launch_that_fails_at_exit_after_writing_its_results_is_reported_as_such(monkeypatch, capsys, tmp_path):
    from zeroshim import _launch

    def fake_launch(target, nproc, out, *args, timeout=900):
        return {"returncode": -6, "log": "done\nterminate called without an active exception\n",
                "ranks": [{"ok": True}] * nproc}

    monkeypatch.setattr(_launch, "launch", fake_launch)
    stub(monkeypatch, "zero3_dummy_loss",
         lambda launch, out, nproc, device: ("failed", "trained", bool(_prove.ranks_of(launch("x", 2, out)))))
    assert _prove.main(args(patches="zero3_dummy_loss", keep=str(tmp_path))) == 0
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["proven"] is True and len(row["aborted_at_exit"]) == 1
    assert "terminate called without an active exception" in row["aborted_at_exit"][0]
    assert "judged by their results: 1 launch(es) failed at exit" in row["with"]


# -- judges' "not run here" and abort paths, on made-up results ---------------------------------------------
def test_mixed_dtype_unreached_is_not_run_only_where_everything_with_zeroshim_was_right():
    proof = _prove.proof("zero3_mixed_dtype_gather")
    ok = {"ok": True, "losses": [1.0], "param_sha256": "x", "trainable_dtypes": ["torch.bfloat16"]}
    rank = {"versions": {"deepspeed": "0.16.9"}, "status": {"state": "applied"}, "reference": ok, "without": ok,
            "with": ok, "alone": ok, "regrouped": 0, "regrouped_alone": 0}
    with pytest.raises(_prove.NotHere, match="never gathers shards of two dtypes"):
        proof.judge([rank])
    for broken in ({"with": {"ok": False, "error": "RuntimeError: x"}}, {"with": dict(ok, losses=[2.0])},
                   {"alone": {"ok": False, "error": "RuntimeError: x"}}):
        assert proof.judge([dict(rank, **broken)])[2] is False, broken


def _gloo_run(wrong=0, losses=(1.0,)):
    return {"ok": True, "gathers": 600, "wrong_gathers": wrong, "saves": 100, "wrong_saves": 0, "first_wrong": None,
            "first_wrong_save": None, "losses": list(losses), "param_sha256": "x"}


def test_gloo_gather_race_not_occurring_is_not_run_but_a_wrong_result_is_not_proven():
    proof = _prove.proof("zero3_gloo_gather")
    persistent = {"ok": True, "losses": [1.0]}
    rank = {"reference": _gloo_run(), "without": _gloo_run(), "with": _gloo_run(), "stats": {"split": 600},
            "persistent/with": persistent, "persistent/reference": persistent}
    with pytest.raises(_prove.NotHere, match="race did not occur"):
        proof.judge([rank])
    assert proof.judge([dict(rank, without=_gloo_run(wrong=3))])[2] is True
    for broken in ({"with": _gloo_run(wrong=1)}, {"with": _gloo_run(losses=(2.0,))},
                   {"without": _gloo_run(losses=(2.0,))}):  # the last: the race changed the model another way
        assert proof.judge([dict(rank, **broken)])[2] is False, broken


def test_moe_gloo_abort_without_zeroshim_is_the_bug_and_a_rank_dying_with_it_is_not_proven():
    proof = _prove.proof("zero3_moe_leaf")
    ref = {"reference": {"losses": [1.0]}, "frozen": {"losses": [2.0]}}  # written before the routed run
    good = dict(ref, run={"losses": [1.0]})
    launches = {}

    def launch(name, nproc, out, *args, timeout=900):
        mode = args[args.index("--mode") + 1]
        return launches[mode]

    launch.aborted = ["without/log.txt (exit -6)"]
    aborted = {"returncode": -6, "ranks": [dict(ref), dict(ref)],
               "log": "op.preamble.length <= op.nbytes. Is there a distributed collective mismatch\n"}
    launches.update(without=aborted, **{"with": {"returncode": 0, "ranks": [good, good], "log": ""}})
    without, _, proven = proof.prove(launch, "/tmp/x", 2, "cpu")
    assert proven and without.startswith("gloo aborted") and launch.aborted == []
    launches["with"] = {"returncode": -11, "ranks": [good, dict(ref)], "log": "Segmentation fault\n"}
    with pytest.raises(_prove.Unproven, match=r"with zeroshim: rank\(s\) 1 died in the routed run"):
        proof.prove(launch, "/tmp/x", 2, "cpu")
    launches["without"] = dict(aborted, log="Killed\n")  # no gloo mismatch: not taken as the bug
    with pytest.raises(_prove.Unproven, match="without zeroshim"):
        proof.prove(launch, "/tmp/x", 2, "cpu")


def test_the_table_fits_100_columns_and_names_no_paths():
    """`zeroshim prove`'s table (issue #45 item 5): one row per patch within 100 columns, the short reason
    only, no file paths; the full texts are in the summary it names."""
    long_path = "/home/user/.venvs/train/lib/python3.11/site-packages/deepspeed/runtime/zero/stage3.py"
    rows = [{"patch": "zero3_conversion_dropped_keys", "state": "applied", "proven": True, "seconds": 41.6,
             "without": f"ZeRO-3, no zeroshim: 17 of 21 parameters differ from the load without ZeRO-3 ({long_path})",
             "with": "with zeroshim: 0 of 21 parameters differ " * 5},
            {"patch": "zero_no_sync", "state": "applied", "proven": False, "seconds": 3.0, "without": "x",
             "with": f"could not run: the launch exited 1, rank(s) 1 wrote no result: RuntimeError (log: {long_path})"},
            {"patch": "numpy2_compat", "state": "skipped", "proven": None, "seconds": 0.0,
             "without": "not run: skipped (not affected: " + "numpy 1.26.4 is outside the range >=2 " * 6 + ")",
             "with": ""}]
    text = _prove.table(rows, {"torch": "2.15.0", "deepspeed": "0.19.8"}, "/tmp/keep/summary.md")
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines), [len(line) for line in lines]
    assert "site-packages" not in text and "/home/user" not in text
    assert any(line.startswith("zero3_conversion_dropped_keys  yes 42s") and "17 of 21" in line for line in lines)
    assert any(line.startswith("zero_no_sync") and " NO " in line and "could not run" in line for line in lines)
    assert "Each row in full: /tmp/keep/summary.md" in text
    full = _prove.details_table(rows, {"torch": "2.15.0"})
    assert long_path in full and rows[0]["with"] in full  # nothing lost there
