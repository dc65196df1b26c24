"""The package list, computed from the tree (everything else is in pyproject.toml).

``patches/`` ships as ``zeroshim.patches`` (never as a top-level ``patches``):
each folder in it is installed as ``zeroshim.patches.<name>`` with its modules
(``__init__.py``, ``scenario.py``, ``proof.py``), and each ``logs/`` folder
as a data-only package with its ``*.log`` files (captured failures that
``zeroshim explain`` is tested on).  No list of patch names is kept here:
adding a folder adds it to the wheel.  ``nox -s packaging`` checks the wheel.
"""

from setuptools import find_namespace_packages, setup

PATCHES = find_namespace_packages("patches", exclude=["__pycache__", "*.__pycache__"])

setup(
    package_dir={"zeroshim": "zeroshim", "zeroshim.patches": "patches"},
    packages=["zeroshim", "zeroshim._bootstrap", "zeroshim.scenarios", "zeroshim.patches"]
    + [f"zeroshim.patches.{name}" for name in PATCHES],
    package_data={f"zeroshim.patches.{name}": ["*.log"] for name in PATCHES if name.endswith(".logs")},
)
