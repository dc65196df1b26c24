"""Scenario of tests/test_prefork.py: what a rank sees of its own process, and a few ZeRO-3 steps.

``--mode train``: records the process (pid, parent, session), its arguments, ``sys.path[0]``, its rank's
variables, the level of zeroshim's logger, whether an earlier launch's change to the ``torch`` module shows, and the losses of 3 ZeRO-3 steps
of a tiny model; sets an attribute on the ``torch`` module (a later launch forked from the same server must not see
it).  ``--mode fail``: rank 1 exits 3 after the process group is up and rank 0 has written its results, rank 0 sleeps (outside any collective: in a
barrier, gloo would see rank 1 go and rank 0 could exit 1 before the launcher saw rank 1's 3).  ``--mode hang``:
every rank sleeps."""

import argparse
import logging
import os
import sys
import time

import torch

from common import ds_config, end, import_deepspeed, init_distributed, train_small, write_results

deepspeed = import_deepspeed(fix_gloo_gathers=True)
LEAK = getattr(torch, "_zs_probe_leak", None)  # set by an earlier launch's ranks: never seen in this one


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.b(self.a(x)).float().pow(2).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", default="train")
    args = parser.parse_args()
    rank, _ = init_distributed()  # calls import_deepspeed() again: the first call's restriction stays
    import zeroshim

    restricted = {name: s.state for name, s in zeroshim.status().items() if s.state != "disabled"}
    results = {"pid": os.getpid(), "ppid": os.getppid(), "session_leader": os.getsid(0) == os.getpid(),
               "argv": sys.argv[1:], "path0": sys.path[0], "leak": LEAK, "zeroshim": restricted,
               "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT",
                                                      "ZEROSHIM_LOG_LEVEL", "ZSLAUNCH_FORKED")},
               # the flag as zeroshim read it (a forked rank reads its own again: zeroshim/_prefork.py)
               "log_level": logging.getLevelName(logging.getLogger("zeroshim").level)}
    if args.mode == "fail":
        write_results(args.out, results)
        if rank == 1:
            # after rank 0 has written its results: on a loaded machine the launcher stopped rank 0 before it
            # wrote them now and then (the test then read no pid to check)
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(args.out, "rank0.json")) and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit(3)
        time.sleep(3600)  # stopped by the launcher once rank 1 has exited
    if args.mode == "hang":
        write_results(args.out, results)
        time.sleep(3600)
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=ds_config(3, micro_batch=2, stage3_param_persistence_threshold=0))
    results["losses"] = train_small(engine, 3)
    torch._zs_probe_leak = rank
    end(args.out, results)


if __name__ == "__main__":
    main()
