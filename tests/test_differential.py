"""The differential matrix (tests/differential/run.py, issue #28 item 1): a small seeded
sample in CI, after the known-bug anchor; the larger sample is `nox -s differential`.

The classifier is also checked on made-up launch results, so that a difference in the
numbers, or a configuration that trains without zeroshim and fails with it, is caught."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "differential"))
import run as differential  # noqa: E402

# Where the sample runs: 0.19.2 is inside the ranges of the most invasive patches (the same as
# `nox -s differential`); the other releases' patch tests cover them.
ENVS = ("ds0.19.2",)
ENVS_REASON = "the differential sample runs in the release inside the most invasive patches' ranges"
SAMPLE = 2  # random configurations after the anchor (about 2 minutes in all on 2 cores: 104 s, 2026-11-26)


@pytest.mark.deepspeed
def test_sample_never_differs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ZS_DIFF_FP16_ON_CPU", "")  # main() sets it for its launches: restored afterwards
    code = differential.main(["--sample", str(SAMPLE), "--max-ranks", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    rows = __import__("json").loads((tmp_path / "results.json").read_text())
    assert code == 0 and not [r for r in rows if r["class"] == "differ"], out
    anchor = rows[0]
    # the anchor fails without zeroshim and trains with it to the run without checkpointing
    assert anchor["class"] == "fixed" and "equal to the reference" in anchor["note"], anchor
    assert out.strip().splitlines()[-1].startswith(f"differential: {SAMPLE + 1} configurations, ")


def _result(losses, sha="a", ok=True, error=None):
    rank = {"ok": ok, "losses": losses, "param_sha256": sha, "updated": True, "error": error}
    return {"ok": ok, "error": error, "ranks": [rank], "seconds": 1.0}


CFG = dict(differential.ANCHORS[0], ckpt="none", twice=False, ranks=1)


@pytest.mark.parametrize("without, with_, expected", [
    (_result([1.0, 0.5]), _result([1.0, 0.5]), "same"),
    (_result([1.0, 0.5]), _result([1.0, 0.50001]), "differ"),
    (_result([1.0, 0.5], sha="a"), _result([1.0, 0.5], sha="b"), "differ"),
    (_result([1.0]), _result([], ok=False, error="RuntimeError: x"), "differ"),
    (_result([], ok=False, error="RuntimeError: x"), _result([1.0]), "fixed"),
    (_result([], ok=False, error="hang"), _result([], ok=False, error="hang"), "failed both ways"),
    (_result([], ok=False, error="ValueError: Type fp16 is not supported"),
     _result([], ok=False, error="ValueError: Type fp16 is not supported"), "not runnable here"),
])
def test_classifier(monkeypatch, tmp_path, without, with_, expected):
    monkeypatch.setattr(differential, "launch", lambda cfg, mode, out: {"without": without, "with": with_}[mode])
    monkeypatch.setenv("ZS_DIFF_FP16_ON_CPU", "0")  # fp16 refused here, not answered by the harness
    cfg = dict(CFG, dtype="fp16") if expected == "not runnable here" else CFG
    assert differential.classify(cfg, tmp_path)["class"] == expected


def test_refusals_are_failures_where_fp16_was_adapted_or_not_fp16(monkeypatch, tmp_path):
    refused = _result([], ok=False, error="ValueError: Type fp16 is not supported")
    monkeypatch.setattr(differential, "launch", lambda cfg, mode, out: refused)
    monkeypatch.setenv("ZS_DIFF_FP16_ON_CPU", "1")
    assert differential.classify(dict(CFG, dtype="fp16"), tmp_path)["class"] == "failed both ways"
    monkeypatch.setenv("ZS_DIFF_FP16_ON_CPU", "0")
    assert differential.classify(CFG, tmp_path)["class"] == "failed both ways"


def test_fixed_to_other_numbers_than_the_reference_differs(monkeypatch, tmp_path):
    runs = {"without": _result([], ok=False, error="RuntimeError: already reduced"), "with": _result([1.0, 0.4])}
    monkeypatch.setattr(differential, "launch",
                        lambda cfg, mode, out: runs[mode] if cfg["ckpt"] != "none" else _result([1.0, 0.5]))
    row = differential.classify(dict(CFG, ckpt="reentrant"), tmp_path)
    assert row["class"] == "differ" and "reference" in row["note"]


def test_sample_is_seeded_and_covers_pairs():
    a, b = differential.sample(6, 0, 2, fp16=False), differential.sample(6, 0, 2, fp16=False)
    assert a == b and len({differential.name_of(c) for c in a}) == 6
    assert all(differential.valid(c) and c["dtype"] != "fp16" and c["ranks"] <= 2 for c in a)
    values = {(k, repr(c[k])) for c in a for k in c}
    assert {("stage", repr(s)) for s in (0, 1, 2, 3)} <= values  # 6 pairwise-greedy draws reach every stage


def test_fix_draws_only_that_axis_value():
    fix = differential.parse_fix(["dtype=fp16", "ranks=2", "twice=True", "persistence=0", "clip=.05"])
    assert fix == {"dtype": "fp16", "ranks": 2, "twice": True, "persistence": "0", "clip": 0.05}
    assert type(fix["ranks"]) is int and type(fix["clip"]) is float
    drawn = differential.sample(4, 0, 4, fix=fix)
    assert len(drawn) == 4 and all(c["dtype"] == "fp16" and c["ranks"] == 2 and c["twice"] and
                                   c["persistence"] == "0" for c in drawn)
    # a narrow pool is drawn whole (the pool shrinks while drawing)
    narrow = differential.parse_fix(["stage=3", "offload=optimizer+param", "ga=1", "clip=0", "dtype=fp32",
                                     "ckpt=none", "training=full", "persistence=0", "ranks=1", "api=raw"])
    pool = differential.space(4, fix=narrow)
    assert len(pool) == 2 and len(differential.sample(10, 0, 4, fix=narrow)) == 2
    for bad in ("dtype=fp17", "nope=1", "ranks", "stage=True", "twice=1", "ga=true"):
        with pytest.raises(SystemExit):
            differential.parse_fix([bad])


def test_fp16_mode(monkeypatch):
    monkeypatch.setattr(differential, "fp16_runnable", lambda: False)
    monkeypatch.setenv("ZS_DIFF_FP16_ON_CPU", "x")  # restored (or removed) after the test
    assert differential.fp16_mode(False) == "left out" and "ZS_DIFF_FP16_ON_CPU" not in __import__("os").environ
    assert differential.fp16_mode(True) == "adapted" and __import__("os").environ["ZS_DIFF_FP16_ON_CPU"] == "1"
    monkeypatch.setattr(differential, "fp16_runnable", lambda: True)
    assert differential.fp16_mode(True) == "native"


@pytest.mark.parametrize("reference, counters, expected, note", [
    (_result([1.0, 0.4]), {"scheduler_dropped_groups": {"dropped_groups": 1}}, "fixed",
     "equal to the reference without checkpointing, run with only scheduler_dropped_groups"),
    (_result([1.0, 0.5]), {"scheduler_dropped_groups": {"dropped_groups": 1}}, "differ",
     "fixed, but not to the reference without checkpointing, run with only scheduler_dropped_groups"),
    (_result([1.0, 0.4]), {}, "fixed", "scheduler_dropped_groups did not act in the reference"),
])
def test_a_reference_that_crashes_on_its_own_runs_with_only_that_crashs_patch(monkeypatch, tmp_path, reference,
                                                                               counters, expected, note):
    """The reference (no checkpointing, without zeroshim) hits the scheduler zip() crash: it runs again with
    zeroshim allowing only scheduler_dropped_groups, which must act, and the fixed row is compared with that."""
    crash = _result([], ok=False, error="ValueError: zip() argument 2 is longer than argument 1")
    reference["ranks"][0]["counters"] = counters
    calls = []

    def launch(cfg, mode, out, only=None):
        calls.append((cfg["ckpt"], mode, only))
        if cfg["ckpt"] != "none":
            return {"without": _result([], ok=False, error="RuntimeError: already reduced"),
                    "with": _result([1.0, 0.4])}[mode]
        return crash if mode == "without" else reference

    monkeypatch.setattr(differential, "launch", launch)
    row = differential.classify(dict(CFG, ckpt="reentrant"), tmp_path)
    assert calls[-1] == ("none", "with", "scheduler_dropped_groups"), calls
    assert row["class"] == expected and note in row["note"], row
