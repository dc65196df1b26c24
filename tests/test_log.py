"""Rank-aware logging (``zeroshim/_log.py``): scopes, once per process, and the one line a
patch logs when it changes what the user's code does."""

import logging
import uuid

import pytest


# -- logging on many ranks -------------------------------------------------------------
@pytest.mark.parametrize("environ,rank0,node", [
    ({}, True, True),
    ({"RANK": "0", "LOCAL_RANK": "0"}, True, True),
    ({"RANK": "9", "LOCAL_RANK": "1"}, False, False),
    ({"RANK": "8", "LOCAL_RANK": "0"}, False, True),          # first rank of the second node
    ({"LOCAL_RANK": "1"}, False, False),                       # no RANK: LOCAL_RANK stands in
    ({"SLURM_PROCID": "3", "SLURM_LOCALID": "0"}, False, True),  # srun without torchrun
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, True, True),
])
def test_log_scopes(monkeypatch, caplog, environ, rank0, node):
    from zeroshim import _log

    for name in _log._GLOBAL_RANK_VARS + _log._LOCAL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.DEBUG, logger="zeroshim"):
        _log.info("rank0 line")
        _log.warning("node line")
        _log.warning("every line", scope=_log.EVERY)
    levels = {r.getMessage(): r.levelname for r in caplog.records}
    assert levels["rank0 line"] == ("INFO" if rank0 else "DEBUG")
    assert levels["node line"] == ("WARNING" if node else "DEBUG")
    assert levels["every line"] == "WARNING"


def test_log_once_per_process(caplog):
    from zeroshim import _log

    key = ("test", uuid.uuid4().hex)
    with caplog.at_level(logging.INFO, logger="zeroshim"):
        assert _log.info("once only", once=key) is True
        assert _log.info("once only", once=key) is False
        _log.forget(key)
        assert _log.info("once only", once=key) is True
    assert [r.getMessage() for r in caplog.records].count("once only") == 2


def test_a_patch_that_changes_user_code_says_so_once_at_warning_with_its_flag(monkeypatch, caplog):
    from zeroshim import _log

    for name in _log._GLOBAL_RANK_VARS + _log._LOCAL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    key = ("some_patch", "acted")
    _log.forget(key)
    with caplog.at_level(logging.DEBUG, logger="zeroshim"):
        assert _log.acted("some_patch", "ran %d thing(s) differently", "the old way crashes", 2) is True
        assert _log.acted("some_patch", "ran %d thing(s) differently", "the old way crashes", 3) is False
    [record] = [r for r in caplog.records if "some_patch" in r.getMessage()]
    assert record.levelname == "WARNING"
    assert record.getMessage() == ("zeroshim[some_patch]: ran 2 thing(s) differently, because the old way "
                                   "crashes. ZEROSHIM_SOME_PATCH=off turns this off.")
    _log.forget(key)
    monkeypatch.setenv("RANK", "1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zeroshim"):
        _log.acted("some_patch", "ran %d thing(s) differently", "the old way crashes", 2)
    assert not [r for r in caplog.records if "some_patch" in r.getMessage()]  # global rank 0 only
    _log.forget(key)
