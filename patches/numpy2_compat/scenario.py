"""Scenario for patch ``numpy2_compat``: ``import deepspeed`` in a fresh interpreter with this patch off
(``without``: fails where the bug exists) and with ``import zeroshim`` first (``with``), see
``common.import_scenario``."""

from common import import_scenario

if __name__ == "__main__":
    import_scenario("numpy2_compat")
