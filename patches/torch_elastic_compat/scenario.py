"""Scenario for patch ``torch_elastic_compat``: ``import deepspeed`` in a fresh interpreter with this patch off
(``without``: fails where the bug exists) and with ``import zeroshim`` first (``with``), see
``common.import_scenario``."""

from common import import_scenario

if __name__ == "__main__":
    import_scenario("torch_elastic_compat")
