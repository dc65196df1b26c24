"""pytest plugin (``-p zs_outcomes``) for tests/dsunit/run.py: one outcome per test id.

DeepSpeed's own tests run in the pytest process's children (``--forked``, then
its ``DistributedTest`` ranks), but their reports come back to this process, so
the outcome recorded here is the one pytest prints.  Written as JSON to
``$ZS_DSUNIT_OUTCOMES`` after every test (``exitstatus`` null: a run killed before
its end keeps what it recorded) and at the end of the session (also when the
session stops early, e.g. DeepSpeed's harness calling ``pytest.exit`` on a hang).
"""

import json
import os
import time

_results = {}
_started = time.time()


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = getattr(report, "longreprtext", "") or ""
    lines = [line for line in text.splitlines() if line.strip()]
    for line in reversed(lines):  # the exception line pytest prints as "E   ..."
        if line.startswith("E "):
            return line[1:].strip()[:400]
    return (lines[-1] if lines else "")[:400]


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "message": "", "seconds": 0.0})
    entry["seconds"] = round(entry["seconds"] + getattr(report, "duration", 0.0), 2)
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["message"] = _message(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        entry["message"] = _message(report)
    if report.when == "teardown":
        _write(None)


def _write(exitstatus) -> None:
    path = os.environ.get("ZS_DSUNIT_OUTCOMES")
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump({"exitstatus": exitstatus, "seconds": round(time.time() - _started, 1),
                       "tests": _results}, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)  # never a half-written file


def pytest_sessionfinish(session, exitstatus):
    _write(int(exitstatus))
