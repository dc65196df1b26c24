"""What zeroshim's wrappers on ZeRO-3's hot paths cost a call where nothing is wrong, without timers.

``attribution.py`` times every wrapper, and its timers cost about a microsecond a call, which on the
paths called hundreds of times a step is most of what it reports.  Here each wrapper runs on its
no-act path against the function it wraps, in one process, interleaved round by round, and the
difference per call is reported (median over rounds, with the lowest and highest round):

* ``Tensor * Tensor`` (both need grad: RMSNorm, SwiGLU), ``Tensor * big constant`` (rotary
  ``cos``/``sin``) and ``Tensor * number``: ``zero3_dummy_loss``'s watched multiplication;
* ``reduce_ready_partitions_and_remove_grads``: ``zero3_dummy_loss``'s replacement of DeepSpeed's
  per-parameter gradient hook (no cut in this backward);
* ``fetch_sub_module``: ``zero3_inference_mode``'s replacement (inference mode off);
* the same two as wrapt wrappers (``Patcher.wrap``), as before, and still where the method is not
  a plain function on its class.

Multiplied by the calls a step that ``attribution.py --model llama`` counts, this gives the
wrappers' own time per step without the timers.  No DeepSpeed needed: the DeepSpeed methods are
stood in for by plain methods that return at once (their own time is not zeroshim's).

    python benchmarks/per_call.py                  # about a minute
    python benchmarks/per_call.py --smoke          # seconds; used by the test suite
"""

import argparse
import json
import statistics
import time


def rounds(plain, wrapped, install, uninstall, calls: int, count: int):
    """Per-call difference (microseconds) of ``wrapped`` over ``plain``, ``count`` rounds interleaved."""
    diffs = []
    for index in range(count):
        order = (False, True) if index % 2 == 0 else (True, False)
        times = {}
        for on in order:
            if on:
                install()
            fn = wrapped if on else plain
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[on] = (time.perf_counter() - start) / calls * 1e6
            if on:
                uninstall()
        diffs.append(times[True] - times[False])
    return {"median_us": statistics.median(diffs), "low_us": min(diffs), "high_us": max(diffs)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.smoke:
        args.calls, args.rounds = 200, 3
    import torch
    import wrapt

    from zeroshim._patcher import Patcher
    from zeroshim.patches import zero3_dummy_loss as dl
    from zeroshim.patches import zero3_inference_mode as im

    results = {}
    a = torch.randn(8, 64, requires_grad=True)
    b = torch.randn(8, 64, requires_grad=True)
    big = torch.randn(8, 64)
    state = {}

    def watch():
        state["patcher"] = Patcher(dl.NAME)
        dl._install(state["patcher"], check=False)
        assert dl._installed

    def unwatch():
        state.pop("patcher").undo()
        dl._forget()

    for label, fn in (("Tensor * Tensor (both need grad)", lambda: a * b),
                      ("Tensor * big constant (no grad)", lambda: a * big),
                      ("Tensor * number", lambda: a * 0.5)):
        results[label] = rounds(fn, fn, watch, unwatch, args.calls, args.rounds)

    class Stage3:
        def reduce_ready_partitions_and_remove_grads(self, param):
            return None

    class Coordinator:
        def fetch_sub_module(self, current_submodule, forward):
            return None

    optimizer, coordinator, param = Stage3(), Coordinator(), torch.nn.Parameter(torch.randn(2))
    im._bind()
    reduce_plain = vars(Stage3)["reduce_ready_partitions_and_remove_grads"]
    fetch_plain = vars(Coordinator)["fetch_sub_module"]

    replacements = {
        "reduce_ready_partitions_and_remove_grads (replacement)":
            (Stage3, "reduce_ready_partitions_and_remove_grads", dl._reduce_ready_replacement(reduce_plain),
             lambda: optimizer.reduce_ready_partitions_and_remove_grads(param)),
        "fetch_sub_module (replacement)":
            (Coordinator, "fetch_sub_module", im._fetch_replacement(fetch_plain),
             lambda: coordinator.fetch_sub_module(None, True)),
        "reduce_ready_partitions_and_remove_grads (the wrapt wrapper, before)":
            (Stage3, "reduce_ready_partitions_and_remove_grads", wrapt.FunctionWrapper(reduce_plain, dl._reduce_ready),
             lambda: optimizer.reduce_ready_partitions_and_remove_grads(param)),
        "fetch_sub_module (the wrapt wrapper, before)":
            (Coordinator, "fetch_sub_module", wrapt.FunctionWrapper(fetch_plain, im._fetch_sub_module),
             lambda: coordinator.fetch_sub_module(None, True)),
    }
    for label, (cls, attr, replacement, call) in replacements.items():
        original = vars(cls)[attr]
        results[label] = rounds(call, call, lambda: setattr(cls, attr, replacement),
                                lambda: setattr(cls, attr, original), args.calls, args.rounds)

    print(f"zeroshim's own cost per call, no timers ({args.rounds} rounds of {args.calls} calls, interleaved; "
          f"torch {torch.__version__})")
    print("| call | median µs | lowest | highest |\n|---|---|---|---|")
    for label, row in results.items():
        print(f"| {label} | {row['median_us']:.3f} | {row['low_us']:.3f} | {row['high_us']:.3f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": results, "args": vars(args), "torch": torch.__version__}, fh, indent=1)


if __name__ == "__main__":
    main()
