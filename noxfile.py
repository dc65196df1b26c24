"""Test environments (the pinned matrix) and the demo.

    nox -s tests            every environment of the matrix, one after another
    nox -s "tests(env='ds0.19.8')"   one of them
    nox -s demo             the checkpointing demo (fails without zeroshim, trains with it)

Each session is its own virtual environment with torch 2.13.0 (CPU; pip takes
the wheel from local disk).  The pins live here, never in pyproject.toml.
"""

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = not os.environ.get("CI")
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests"]

TORCH = "torch==2.13.0"

# name -> packages installed on top of torch (DeepSpeed builds with DS_BUILD_OPS=0).
MATRIX = {
    "ds0.19.8": ["deepspeed==0.19.8", "transformers==4.57.*", "peft==0.17.*", "accelerate>=1.0"],
}
DEMO_ENV = "ds0.19.8"


def _install(session, env_name):
    session.install(TORCH)
    session.install(*MATRIX[env_name], env={"DS_BUILD_OPS": "0"})
    session.install(".[test]")


@nox.session
@nox.parametrize("env", list(MATRIX))
def tests(session, env):
    """The test suite in one pinned environment."""
    _install(session, env)
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    # `pytest` (not `python -m pytest`): the installed zeroshim is tested, not the source tree.
    session.run("pytest", "-p", "no:cacheprovider", *session.posargs,
                env={"OMP_NUM_THREADS": "1", "ZEROSHIM_TEST_ENV": env})


@nox.session
def demo(session):
    """Reentrant checkpointing under ZeRO-2/3 on 2 ranks: without, then with zeroshim."""
    _install(session, DEMO_ENV)
    session.run("python", "examples/checkpoint_demo.py", *session.posargs, env={"OMP_NUM_THREADS": "1"})
