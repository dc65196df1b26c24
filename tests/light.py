"""Print the patches a light environment proves (``tests/conftest.py`` ``light_patches``), as JSON after
``light patches: ``: noxfile.py runs their test files there.  Run with the environment's interpreter and
``ZSTEST_MATRIX`` (the full environments' pins)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zeroshim  # noqa: E402
from conftest import light_patches, matrix  # noqa: E402
from zeroshim._core import patch_names  # noqa: E402

#: the line noxfile.py reads (the process may log other lines)
PREFIX = "light patches: "
print(PREFIX + json.dumps(light_patches([zeroshim.get_patch(name) for name in patch_names()], matrix())))
