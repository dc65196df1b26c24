"""Scenario for patch ``zero_empty_params``: ZeRO-1 and ZeRO-2 on a model of flat trainable parameters, some of
them zero-sized, 2 ranks, SGD, 2 steps.

Layouts (sizes in order; 32 elements, so each rank's partition holds 16):

* ``trailing``: 16, 16, 0: the empty parameter ends the group, in no partition (the backward's ``KeyError``);
* ``interior``: 8, 0, 16, 0, 8: an empty parameter strictly inside each rank's partition (``initialize``'s
  ``AssertionError`` on both ranks);
* ``starts``: 0, 16, 0, 16: an empty parameter at the start of each rank's partition (trains; the parameter after
  it gets the wrong gradient index).

Each has one empty parameter per rank's partition where that matters, so a failure without zeroshim stops both
ranks at the same point (never one rank inside a collective the other left).  The loss is
``sum(w * p) * x`` with dyadic weights and inputs: every gradient, average and update is exact in fp32.

Runs, in one process per rank, for ZeRO stage ``s`` in 1 and 2 and each layout ``L``:

* ``s/L/reference``: the same layout without its empty parameters (the same offsets, the same partitions);
* ``s/L/without``: the layout, no zeroshim;
* ``s/L/with``: the layout with zeroshim;
* ``bf16/L/reference``, ``bf16/L/with``: ZeRO-2 in bf16, with the gradient overflow check where the release has
  it (it reads the empty gradients too);
* ``offload/L/reference``, ``offload/L/with``: ZeRO-2 with the optimizer offloaded to the CPU;
* ``fp32acc/L/reference``, ``fp32acc/L/with``: ZeRO-1 in bf16 with ``grad_accum_dtype`` fp32 (DeepSpeed's
  ``BF16_Optimizer`` where the release builds it for that config, which links its partition by the same code),
  both with zeroshim (the reference for the fix of another patch on 0.18.5-0.18.x; this one leaves it alone);
* ``s/plain/without``, ``s/plain/with``: a layout without empty parameters, without and with zeroshim.

Each run records the losses, a digest of the non-empty parameters, whether every linked parameter's
``_index_in_param_group`` is its place in the partition's list (``params_in_partition``, what the gradient list
follows; read on this rank only), and where it is safe (every run but ``without``), the sums of each non-empty
parameter's gradient by ``deepspeed.utils.safe_get_full_grad`` before each step.
"""

import hashlib
import importlib.util

import torch
import torch.distributed as dist
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed

deepspeed = import_deepspeed()
LAYOUTS = {"trailing": (16, 16, 0), "interior": (8, 0, 16, 0, 8), "starts": (0, 16, 0, 16), "plain": (8, 16, 8)}
STEPS = 2
#: bf16.check_grad_overflow exists (DeepSpeed >= 0.17.1, which has runtime/precision_config.py)
CHECKS_OVERFLOW = importlib.util.find_spec("deepspeed.runtime.precision_config") is not None


class Flat(nn.Module):
    """Flat parameters of ``sizes`` (``(place in the layout, size)``: a parameter's values and weights follow its
    place, so a layout without its empty parameters has the same numbers)."""

    def __init__(self, sizes):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.arange(n, dtype=torch.float32) / 8 + i) for i, n in sizes)
        for i, n in sizes:
            # weights that differ by place: parameters of one size get different gradients (a mix-up shows)
            self.register_buffer(f"w{i}", (torch.arange(n, dtype=torch.float32) % 4 - 1.5) / 2 + i / 4)
        self.places = [i for i, _ in sizes]

    def forward(self, x):
        return sum((p * getattr(self, f"w{i}")).sum() for i, p in zip(self.places, self.ps)) * x


def _index_ok(optimizer) -> bool:
    """Every parameter linked to this rank's partition carries its place in ``params_in_partition``."""
    for group in getattr(optimizer, "params_in_partition", []):
        for place, p in enumerate(group):
            if getattr(p, "_hp_mapping", None) is not None and getattr(p, "_index_in_param_group", None) != place:
                return False
    return True


def train(stage, layout, empty=True, bf16=False, offload=False, probe=True, fp32_accumulation=False) -> dict:
    sizes = [(i, n) for i, n in enumerate(LAYOUTS[layout]) if empty or n]
    model = Flat(sizes)
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    cfg = ds_config(stage, micro_batch=1, bf16=bf16, **zero)
    cfg["zero_force_ds_cpu_optimizer"] = False
    if fp32_accumulation:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    elif bf16 and CHECKS_OVERFLOW:
        # the gradient overflow check (0.19.3's default, a setting from 0.17.1; fp16 always) reads every gradient
        # of the partition, the empty ones too
        cfg["bf16"]["check_grad_overflow"] = True
    optimizer = torch.optim.SGD(model.parameters(), lr=2**-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    from deepspeed.utils import safe_get_full_grad

    full = [p for p in model.ps if p.numel()]
    losses, grads = [], []
    index_ok = _index_ok(engine.optimizer)
    for step in range(STEPS):
        x = torch.tensor(float(1 + dist.get_rank() + step))
        loss = engine(x)
        engine.backward(loss)
        if probe:
            grads.append([safe_get_full_grad(p).float().flatten().tolist() for p in full])
        engine.step()
        losses.append(loss.item())
    digest = hashlib.sha256()
    for p in full:
        digest.update(p.detach().float().contiguous().numpy().tobytes())
    return {"losses": losses, "param_sha256": digest.hexdigest(), "index_ok": index_ok, "grads": grads,
            "sums": [float(p.detach().double().sum()) for p in full], "optimizer": type(engine.optimizer).__name__}


def main():
    out, results = begin()
    for stage in (1, 2):
        for layout in ("trailing", "interior", "starts"):
            results[f"{stage}/{layout}/reference"] = attempt(train, stage, layout, empty=False)
            results[f"{stage}/{layout}/without"] = attempt(train, stage, layout, probe=False)
        results[f"{stage}/plain/without"] = attempt(train, stage, "plain")
    for layout in ("trailing", "interior", "starts"):
        results[f"bf16/{layout}/reference"] = attempt(train, 2, layout, empty=False, bf16=True)
        results[f"offload/{layout}/reference"] = attempt(train, 2, layout, empty=False, offload=True)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero_empty_params"].as_dict()
    for layout in ("trailing", "interior", "starts"):
        # with zeroshim: DeepSpeed 0.18.5-0.18.x's BF16_Optimizer leaves the last micro-batch out of the average
        # (patch bf16_zero1_last_microbatch), here every micro-batch; this patch does not act on a model without
        # zero-sized parameters (its stats count the with-runs only)
        results[f"fp32acc/{layout}/reference"] = attempt(train, 1, layout, empty=False, bf16=True,
                                                         fp32_accumulation=True)
    for stage in (1, 2):
        for layout in ("trailing", "interior", "starts"):
            results[f"{stage}/{layout}/with"] = attempt(train, stage, layout)
        results[f"{stage}/plain/with"] = attempt(train, stage, "plain")
    for layout in ("trailing", "interior", "starts"):
        results[f"bf16/{layout}/with"] = attempt(train, 2, layout, bf16=True)
        results[f"offload/{layout}/with"] = attempt(train, 2, layout, offload=True)
        results[f"fp32acc/{layout}/with"] = attempt(train, 1, layout, bf16=True, fp32_accumulation=True)
    results["stats"] = dict(zeroshim.stats("zero_empty_params"))
    end(out, results)


if __name__ == "__main__":
    main()
