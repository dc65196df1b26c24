"""Scenario for patch ``bf16_full_grad``: bf16, ZeRO-1, ``grad_accum_dtype: fp32`` (DeepSpeed's ``BF16_Optimizer``),
a 6 -> 5 -> 3 MLP (53 elements: the two ranks' partitions cut the first weight), client SGD (lr 0.1, so a gradient
twice as large moves the weights exactly twice as far), 2 ranks, 2 steps of ``gradient_accumulation_steps`` 2, each
rank its own data.

At the end of each accumulation (after the backward, before ``step()``) a run records the optimizer's own fp32
gradient of each parameter (``BF16_Optimizer.fp32_groups_gradients``: what the step uses), then:

* ``get``: records what ``safe_get_full_grad`` returns for each parameter;
* ``set``: ``safe_set_full_grad(param, 2 * that fp32 gradient)`` for each parameter;
* ``update``: ``safe_update_full_grad_vectorized(params, lambda grad, param: 2 * grad)``;
* ``plain``: nothing; ``double``: nothing, with the loss times 2 (every gradient exactly twice as large: the
  weights ``set`` and ``update`` must end with).

each without zeroshim, then with it.  ``other/get``, ``other/set`` and ``other/update``: bf16 ZeRO-2 without
``grad_accum_dtype`` (ZeRO's own optimizer, whose full-gradient calls work): the same with and without zeroshim.
``update`` passes the parameters as a generator, as ``engine.module.parameters()`` is.  The BF16_Optimizer runs
all-reduce in fp32 (``communication_data_type``), so that ``expected`` (each parameter's gradients as autograd
hands them over, summed in fp32 over the accumulation and averaged over the ranks) is exact.  DeepSpeed < 0.15.3 has
no ``safe_set_full_grad``: its ``set`` and ``update`` runs record ``absent``.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
STEPS, GA, MICRO = 2, 2, 2


def _buffer(engine) -> list:
    """The optimizer's fp32 gradient of each parameter (BF16_Optimizer), or []."""
    groups = getattr(engine.optimizer, "fp32_groups_gradients", None)
    return [g.detach().float().clone() for g in groups[0]] if groups else []


def _adder(total):
    def hook(grad):
        total.add_(grad.float())  # returns None: the gradient goes on unchanged

    return hook


def _values(tensors) -> list:
    return [t.detach().float().flatten().tolist() for t in tensors]


def train(call="plain", scale=1.0, fp32_accum=True, stage=1) -> dict:
    import torch.distributed as tdist

    from deepspeed import utils as ds_utils

    if call in ("set", "update") and not hasattr(ds_utils, "safe_set_full_grad"):
        return {"absent": True}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    cfg = ds_config(stage, micro_batch=MICRO)
    cfg["gradient_accumulation_steps"] = GA
    if fp32_accum:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        # (the default all-reduces bf16 gradients in bf16: the expected values below would be rounded otherwise)
        cfg["communication_data_type"] = "fp32"
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    params = list(engine.module.parameters())
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses, buffers, read, dtypes, expected = [], [], [], [], []
    # the independent reference: every micro-batch's gradient of each parameter as autograd hands it to DeepSpeed,
    # summed in fp32 over the accumulation, then averaged over the ranks
    sums = [torch.zeros(p.shape) for p in params]
    for total, p in zip(sums, params):
        p.register_hook(_adder(total))
    for micro in range(STEPS * GA):
        x = torch.randn(MICRO, 6, generator=gen).to(torch.bfloat16)
        loss = engine(x).float().pow(2).mean() * scale
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            averaged = []
            for total in sums:
                summed = total.clone()
                tdist.all_reduce(summed)
                averaged.append(summed / tdist.get_world_size())
                total.zero_()
            expected.append(_values(averaged))
            buffer = _buffer(engine)
            buffers.append(_values(buffer))
            if call == "get":
                grads = [ds_utils.safe_get_full_grad(p) for p in params]
                read.append(_values(grads))
                dtypes = [str(g.dtype) for g in grads]
            elif call == "set":
                full = buffer or [ds_utils.safe_get_full_grad(p).float() for p in params]
                for p, g in zip(params, full):
                    ds_utils.safe_set_full_grad(p, 2 * g.reshape(p.shape))
            elif call == "update":
                # a generator, as engine.module.parameters() is
                ds_utils.safe_update_full_grad_vectorized(iter(params), lambda grad, param: 2 * grad)
        engine.step()
        losses.append(loss.item() / scale)  # exact: the double run's losses are those of the plain run
    return {"losses": losses, "optimizer": type(engine.optimizer).__name__, "buffers": buffers, "read": read,
            "read_dtypes": dtypes, "expected": expected, **param_digest(engine)}


CALLS = ("get", "set", "update", "plain", "double")


def _run(call: str) -> dict:
    return attempt(train, call="plain" if call == "double" else call, scale=2.0 if call == "double" else 1.0)


def main():
    out, results = begin()
    for call in CALLS:
        results[f"{call}/without"] = _run(call)
    results["other/get/without"] = attempt(train, call="get", fp32_accum=False, stage=2)
    results["other/set/without"] = attempt(train, call="set", fp32_accum=False, stage=2)
    results["other/update/without"] = attempt(train, call="update", fp32_accum=False, stage=2)

    zeroshim = enable_zeroshim()
    results["status"] = zeroshim.status()["bf16_full_grad"].as_dict()
    for call in CALLS:
        results[f"{call}/with"] = _run(call)
    results["other/get/with"] = attempt(train, call="get", fp32_accum=False, stage=2)
    results["other/set/with"] = attempt(train, call="set", fp32_accum=False, stage=2)
    results["other/update/with"] = attempt(train, call="update", fp32_accum=False, stage=2)
    results["stats"] = dict(zeroshim.stats("bf16_full_grad"))
    end(out, results)


if __name__ == "__main__":
    main()
