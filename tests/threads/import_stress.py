"""Threads importing patch targets while an apply function imports another target (issue #47 item 4).

Per run: two throwaway patches; thread 1 imports the second one's target (a module that takes 20 ms to
execute, so its import lock is held); 5 ms later thread 2 imports the first one's target (odd runs) or
registers the first patch while its target is imported already (even runs: ``sync`` applies it at once);
that patch's apply function imports the slow module.  With apply under zeroshim's global lock: thread 2 holds that lock and waits for the
slow module's import lock; thread 1, at the end of that import, fires its hook, which waits for zeroshim's
lock: a deadlock (20 of 20 single runs before the fix).  Prints ``runs=N deadlocks=D applied=A``; exit 0
when every run applied both patches.  ``python import_stress.py [RUNS]``; ``JOIN_S``: seconds before a run
counts as deadlocked (10)."""
import os
import sys
import tempfile
import threading
import time

runs = int(sys.argv[1]) if len(sys.argv) > 1 else 100
folder = tempfile.mkdtemp()
sys.path.insert(0, folder)
import zeroshim  # noqa: E402
from zeroshim import _core  # noqa: E402
from zeroshim._declare import Patch  # noqa: E402

applied = []
deadlocks = 0
for run in range(runs):
    first, slow = f"zs_stress_first_{run}", f"zs_stress_slow_{run}"
    with open(os.path.join(folder, first + ".py"), "w") as fh:
        fh.write("VALUE = 1\n")
    with open(os.path.join(folder, slow + ".py"), "w") as fh:
        fh.write("import time\ntime.sleep(0.02)\nVALUE = 2\n")

    def apply_first(module, patcher, slow=slow):
        __import__(slow)  # an apply function that imports (as patches import deepspeed's submodules)
        applied.append((run, "first"))

    def apply_slow(module, patcher):
        applied.append((run, "slow"))

    def register(name, targets):
        _core.register(Patch(name=name, summary="stress", signatures=(), affects={}, targets=targets,
                             changes=("error",)))

    register(f"stress_slow_{run}", {slow: apply_slow})
    if run % 2:  # the first target is imported by another thread, whose import fires the hook
        register(f"stress_first_{run}", {first: apply_first})
        other = threading.Thread(target=__import__, args=(first,), daemon=True)
    else:  # the first target is imported already: registering the patch (sync) applies it at once
        __import__(first)
        other = threading.Thread(target=register, args=(f"stress_first_{run}", {first: apply_first}),
                                 daemon=True)
    loader = threading.Thread(target=__import__, args=(slow,), daemon=True)  # holds slow's import lock
    loader.start()
    time.sleep(0.005)
    other.start()
    loader.join(float(os.environ.get("JOIN_S", "10")))
    other.join(float(os.environ.get("JOIN_S", "10")))
    if loader.is_alive() or other.is_alive():
        deadlocks += 1
        print(f"run {run}: DEADLOCK", flush=True)
        break
print(f"runs={run + 1} deadlocks={deadlocks} applied={len(applied)}", flush=True)
os._exit(1 if deadlocks or len(applied) != 2 * (run + 1) else 0)
