"""What the reproductions share (``common.py``).  Each patch's reproduction lives
in its own folder, ``patches/<name>/scenario.py``, run as a script under
torchrun (one process per rank) by the test suite and by ``zeroshim prove``
(``zeroshim/_launch.py`` puts this folder on the ranks' ``PYTHONPATH``).  Each
records, per rank, what happened without zeroshim (``without``), with it
(``with``) and in a reference run (``reference``), in ``<out>/rank<R>.json``.
Nothing here is imported by ``import zeroshim``.
"""
