"""Activates zeroshim in every Python process started under ``zeroshim-run``.

``zeroshim-run`` puts this directory first on PYTHONPATH, so Python's ``site``
imports this ``sitecustomize`` at start-up, in every process and every rank
(torchrun, the deepspeed launcher, multiprocessing spawn, tools such as
llamafactory-cli).  It imports zeroshim (lazy: nothing heavy is imported) and
then runs the ``sitecustomize`` this one shadows, if there is one.
"""

import os
import sys


def _activate():
    try:
        import zeroshim  # noqa: F401
    except Exception as exc:  # a child Python without zeroshim installed: say so, carry on
        sys.stderr.write(f"zeroshim-run: zeroshim is not active in {sys.executable}: {exc!r}\n")


def _chain_original():
    """Run the next ``sitecustomize`` on sys.path (the one this file shadows)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_activate()
_chain_original()
