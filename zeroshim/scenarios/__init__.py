"""Reproductions of the failures zeroshim fixes, run as scripts under torchrun
(one process per rank) by the test suite and by ``zeroshim prove``.  Each
records, per rank, what happened without zeroshim, with it and in a reference
run, in ``<out>/rank<R>.json``; ``common.py`` holds what they share.  Nothing
here is imported by ``import zeroshim``.
"""
