"""Benchmark mode (``ZEROSHIM_TIMING``, zeroshim/_timing.py): a timed wrapper counts its own time
only, not the wrapped function's nor the user's work it runs another way; off by default."""

import subprocess
import sys

from harness import clean_env

CODE = r"""
import time
from zeroshim import _timing
from zeroshim._patcher import Patcher

class Target:
    def work(self, seconds):
        time.sleep(seconds)
        return seconds

def wrapper(wrapped, instance, args, kwargs):
    time.sleep(0.05)                          # zeroshim's own time
    with _timing.original_work():
        time.sleep(1.0)                       # the user's work, run another way
    return wrapped(*args, **kwargs)           # the original: 0.2 s

p = Patcher("demo")
p.wrap(Target, "work", wrapper)
assert Target().work(0.2) == 0.2
print(_timing.ENABLED, round(_timing.report().get("demo", {}).get("seconds", -1), 2))
"""


def run(value):
    env = clean_env()
    if value is not None:
        env["ZEROSHIM_TIMING"] = value
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split(), proc.stderr


def test_own_time_only():
    """Orderings, not a window (a loaded machine oversleeps): at least the wrapper's own 0.05 s (a sleep never
    ends early), and less than its own time plus the user's 1 s run another way (so that is not counted, nor,
    a fortiori, the original's 0.2 s).  The user's work was 0.1 s: a rehearsal on a loaded 2-core machine
    counted 0.16 s, the 0.05 s sleep overslept."""
    (enabled, seconds), _ = run("1")
    assert enabled == "True" and 0.05 <= float(seconds) < 0.05 + 1.0, seconds


def test_off_by_default_and_bad_values_leave_it_off_loudly():
    (enabled, seconds), _ = run(None)
    assert (enabled, seconds) == ("False", "-1")
    (enabled, seconds), err = run("maybe")
    assert (enabled, seconds) == ("False", "-1") and "ZEROSHIM_TIMING='maybe' cannot be read" in err, err


REPLACEMENT = r"""
import time
from zeroshim import _timing
from zeroshim._patcher import Patcher

class Target:
    def work(self):
        time.sleep(1.0)                       # what the replacement replaces: not zeroshim's

call = _timing.original(Target.work)

def work(self):
    time.sleep(0.05)                          # zeroshim's own time
    return call(self)

Patcher("demo").set(Target, "work", work)
Target().work()
entry = _timing.report()["demo"]
bias = _timing.bias(2000)
print(round(entry["seconds"], 2), entry["calls"], entry["function_calls"], 0 < bias["wrapper"] < 1e-3,
      0 < bias["function"] < 1e-3, "demo" in _timing.report() and len(_timing.report()) == 1)
"""


def test_a_replacement_counts_its_own_time_less_what_it_replaced_and_the_bias_is_small():
    env = clean_env(ZEROSHIM_TIMING="1")
    proc = subprocess.run([sys.executable, "-c", REPLACEMENT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seconds, calls, function_calls, *flags = proc.stdout.split()
    assert 0.05 <= float(seconds) < 1.0 and (calls, function_calls) == ("1", "1"), proc.stdout
    assert flags == ["True", "True", "True"], proc.stdout
