"""On PYTHONPATH in both runs of tests/dsunit/run.py (in the zeroshim run after zeroshim's own
bootstrap, which chains to this file), so Python runs it in every process of both runs, the ranks
DeepSpeed's harness starts included:

1. cpu_harness.install(): the CPU adaptations of DeepSpeed's test references (cpu_harness.py), the
   same in both runs.  It does not import zeroshim (the probe checks that the plain ranks have none).
2. In the zeroshim run only (``$ZS_DSUNIT_ZSLOG`` set): every process that logs on the ``zeroshim``
   logger (the pytest process and each rank DeepSpeed's harness starts) also appends those records,
   with the test that was running (``PYTEST_CURRENT_TEST``, inherited by the ranks), to
   ``$ZS_DSUNIT_ZSLOG.<pid>``.  pytest-forked keeps the ranks' own stdout/stderr, so this is where
   their zeroshim lines are read from."""

import json
import logging
import os


class _ToFile(logging.Handler):
    def emit(self, record):
        try:
            line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
                    "level": record.levelname, "msg": record.getMessage(), "pid": os.getpid()}
            with open(f"{os.environ['ZS_DSUNIT_ZSLOG']}.{os.getpid()}", "a") as f:
                f.write(json.dumps(line) + "\n")
        except Exception:  # never disturb the test
            pass


try:
    import cpu_harness  # tests/dsunit, on PYTHONPATH after this folder
except ImportError:  # a process started without the runner's PYTHONPATH
    cpu_harness = None
if cpu_harness is not None:
    cpu_harness.install()

if os.environ.get("ZS_DSUNIT_ZSLOG"):
    logging.getLogger("zeroshim").addHandler(_ToFile())
