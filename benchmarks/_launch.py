"""The benchmarks use zeroshim's one launcher (``zeroshim/_launch.py``: a port for
one DeepSpeed run and the /dev/shm cleanup after it), loaded from its file so
that these scripts -- which also run as the benchmark's workers -- never import
the ``zeroshim`` package (that would apply its patches) unless a run asks for
it.  (Imported as ``_launch``: the scripts run from this folder.)"""

import importlib.util
import os

_spec = importlib.util.find_spec("zeroshim")  # finds the package without importing it
_path = os.path.join(list(_spec.submodule_search_locations)[0], "_launch.py")
_module_spec = importlib.util.spec_from_file_location("zeroshim_launch", _path)
_module = importlib.util.module_from_spec(_module_spec)
_module_spec.loader.exec_module(_module)

master_port = _module.master_port
