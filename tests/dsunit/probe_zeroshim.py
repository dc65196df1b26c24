"""Copied by tests/dsunit/run.py into DeepSpeed's test tree as ``unit/test_zeroshim_probe.py``
(never collected from this repository: the name is not ``test_*``).

Runs first in both runs, through DeepSpeed's own ``DistributedTest`` harness (2
ranks started the way every other test's ranks are), and checks what the run
claims: in the plain run no rank has zeroshim; in the zeroshim run every rank
has it and it has applied its DeepSpeed patches.  Each rank writes what it saw
to ``$ZS_DSUNIT_PROBE.<rank>.json``.
"""

import json
import os
import sys

import deepspeed  # noqa: F401  (imported as every DeepSpeed test does: zeroshim's post-import hooks fire)
import deepspeed.comm as dist
from unit.common import DistributedTest


class TestZeroshimProbe(DistributedTest):
    world_size = 2

    def test_zeroshim_in_every_rank(self):
        expect = os.environ["ZS_DSUNIT_EXPECT"]
        seen = {"rank": dist.get_rank(), "pid": os.getpid(), "zeroshim": "zeroshim" in sys.modules}
        if seen["zeroshim"]:
            import zeroshim

            seen["states"] = {name: st.state for name, st in zeroshim.status().items()}
        with open(f"{os.environ['ZS_DSUNIT_PROBE']}.{dist.get_rank()}.json", "w") as f:
            json.dump(seen, f, indent=1, sort_keys=True)
        if expect == "off":
            assert not seen["zeroshim"], "zeroshim is active in a rank of the plain run"
        else:
            assert seen["zeroshim"], "zeroshim is not active in this rank"
            assert "applied" in seen["states"].values(), f"no zeroshim patch applied: {seen['states']}"
