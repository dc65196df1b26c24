"""On PYTHONPATH (after zeroshim's own bootstrap, which chains to this file) in the zeroshim run of
tests/dsunit/run.py only: every process that logs on the ``zeroshim`` logger (the pytest process and
each rank DeepSpeed's harness starts) also appends those records, with the test that was running
(``PYTEST_CURRENT_TEST``, inherited by the ranks), to ``$ZS_DSUNIT_ZSLOG.<pid>``.  pytest-forked keeps
the ranks' own stdout/stderr, so this is where their zeroshim lines are read from."""

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


if os.environ.get("ZS_DSUNIT_ZSLOG"):
    logging.getLogger("zeroshim").addHandler(_ToFile())
