"""The benchmarks use zeroshim's one launcher (``zeroshim/_launch.py``: a port for
one DeepSpeed run and the /dev/shm cleanup after it) and its system-wide memory
meter (``zeroshim/_memory.py``), loaded from their files so that these scripts
-- which also run as the benchmark's workers -- never import the ``zeroshim``
package (that would apply its patches) unless a run asks for it.  (Imported as
``_launch``: the scripts run from this folder.)"""

import importlib.util
import os

_spec = importlib.util.find_spec("zeroshim")  # finds the package without importing it


def _load(filename: str):
    path = os.path.join(list(_spec.submodule_search_locations)[0], filename)
    module_spec = importlib.util.spec_from_file_location("zeroshim" + filename[:-3], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


master_port = _load("_launch.py").master_port
system_used_mb = _load("_memory.py").system_used_mb  # MemTotal - MemAvailable, MiB (None where unreadable)
