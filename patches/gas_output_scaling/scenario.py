"""Scenario for patch ``gas_output_scaling``: fp32, an 8 -> 16 -> 4 MLP (tanh), SGD at a learning rate of 0.1, 2
ranks, each its own data, ``gradient_accumulation_steps`` 4 (a power of two: every division by it is exact), 2 steps,
ZeRO-2 unless named.

Runs, in one process per rank (``/without`` before ``import zeroshim``, ``/with`` after):

* ``reference``: the forward returns the loss alone (one hooked output, divided once: right on every release);
* ``plain/with``: the same with zeroshim (a healthy run: unchanged, bit for bit);
* ``dict/...``: the forward returns ``{"loss": ..., "logits": ...}``, as a Hugging Face ``ModelOutput`` does
  (0.18.3-0.19.5: the gradient is divided at ``loss`` and again at ``logits``);
* ``hidden/...``: ``{"loss", "logits", "hidden"}`` (divided three times on the path through ``hidden``);
* ``z1/reference``, ``z1/dict/...``: the same at ZeRO-1;
* ``z3/reference``, ``z3/dict/...``: at ZeRO-3 (its output hooks are off the loss's path: recorded);
* ``shared/reference``: the loss is the engine's output plus an auxiliary term computed inside the forward;
  ``shared/...``: the same term computed outside, with ``engine.module`` (DeepSpeed #8224: not divided);
* ``trainer/...``: ``engine.backward(loss / 4, scale_wrt_gas=False)`` on the dict output, as the HF Trainer does from
  4.49 (0.18.3 divides again);
* ``logits/...``: the forward returns the logits and the loss is computed outside (one hooked output: right on every
  release, and the division moves to the loss with zeroshim: the same bits at 4 micro-batches);
  ``logits3/...``: the same at 3 micro-batches (the division is not exact: recorded, not judged);
* ``ga1/...``: the dict output with ``gradient_accumulation_steps`` 1 (nothing to divide);
* ``direct/...``: the dict output and ``outputs["loss"].backward()`` instead of ``engine.backward`` (divided at each
  output on every release from 0.18.3, 0.19.8 included; zeroshim leaves it: recorded);
* ``two/...``: one loss over two engines' outputs (ZeRO-1, one micro-batch), ``a.backward(loss)``: each engine's
  gradient against the true one divided by 4 (right on every release; zeroshim must not divide the other engine's
  part twice).

The dict runs call ``engine.backward(loss=...)``, ``trainer`` passes its arguments by position.

Each run records the losses, the gradient norm DeepSpeed reports at each step and a digest of the parameters.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
MICRO, STEPS = 4, 2


class Net(nn.Module):
    def __init__(self, output: str, aux_inside: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.hidden, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.output, self.aux_inside = output, aux_inside

    def aux(self, x):
        """An auxiliary term over the same parameters."""
        return 0.5 * self.head(torch.tanh(self.hidden(0.5 * x))).pow(2).mean()

    def forward(self, x, y):
        hidden = torch.tanh(self.hidden(x))
        logits = self.head(hidden)
        if self.output == "logits":
            return logits
        loss = (logits - y).pow(2).mean()
        if self.aux_inside:
            loss = loss + self.aux(x)
        if self.output == "dict":
            return {"loss": loss, "logits": logits}
        if self.output == "hidden":
            return {"loss": loss, "logits": logits, "hidden": hidden}
        return loss


def train(stage=2, output="loss", ga=4, aux="none", trainer=False, direct=False) -> dict:
    model = Net(output, aux_inside=aux == "inside")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = ds_config(stage, micro_batch=MICRO, bf16=False)
    cfg["gradient_accumulation_steps"] = ga
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses, norms = [], []
    for _ in range(STEPS * ga):
        x, y = torch.randn(MICRO, 8, generator=gen), torch.randn(MICRO, 4, generator=gen)
        out = engine(x, y)
        if output == "logits":
            loss = (out - y).pow(2).mean()
        else:
            loss = out["loss"] if isinstance(out, dict) else out
        if aux == "outside":
            loss = loss + engine.module.aux(x)
        losses.append(loss.item())
        if direct:
            loss.backward()
        elif trainer:
            engine.backward(loss / ga, False, False)  # positional: retain_graph, scale_wrt_gas
        elif output == "dict":
            engine.backward(loss=loss)  # the keyword form
        else:
            engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
    return {"losses": losses, "grad_norms": norms, **param_digest(engine)}


def two_engines() -> dict:
    """One loss over two engines' outputs, ``a.backward(loss)``, ZeRO-1: each engine's local gradient against the
    true gradient divided by the accumulation steps (1.0 is right)."""
    cfg = ds_config(1, micro_batch=MICRO, bf16=False)
    cfg["gradient_accumulation_steps"] = 4
    torch.manual_seed(0)
    nets = (nn.Linear(8, 4), nn.Linear(8, 4))
    copies = [nn.Linear(8, 4) for _ in nets]
    for copy, net in zip(copies, nets):
        copy.load_state_dict(net.state_dict())
    a, b = (deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config=cfg)[0]
            for net in nets)
    x = torch.randn(MICRO, 8, generator=torch.Generator().manual_seed(100 + torch.distributed.get_rank()))
    a.backward(a(x).pow(2).mean() + b(x).pow(2).mean())
    (copies[0](x).pow(2).mean() + copies[1](x).pow(2).mean()).backward()
    ratios = [float(p.grad.norm() / (q.grad / 4).norm()) for engine, copy in zip((a, b), copies)
              for p, q in zip(engine.module.parameters(), copy.parameters())]
    return {"a_ratios": ratios[:2], "b_ratios": ratios[2:]}


RUNS = {
    "dict": dict(output="dict"),
    "hidden": dict(output="hidden"),
    "z1/dict": dict(stage=1, output="dict"),
    "z3/dict": dict(stage=3, output="dict"),
    "shared": dict(aux="outside"),
    "trainer": dict(output="dict", trainer=True),
    "logits": dict(output="logits"),
    "logits3": dict(output="logits", ga=3),
    "ga1": dict(output="dict", ga=1),
    "direct": dict(output="dict", direct=True),
}


def main():
    out, results = begin()
    results["reference"] = attempt(train)
    results["z1/reference"] = attempt(train, stage=1)
    results["z3/reference"] = attempt(train, stage=3)
    results["shared/reference"] = attempt(train, aux="inside")
    for name, kwargs in RUNS.items():
        results[f"{name}/without"] = attempt(train, **kwargs)
    results["two/without"] = attempt(two_engines)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["gas_output_scaling"].as_dict()
    results["plain/with"] = attempt(train)
    for name, kwargs in RUNS.items():
        results[f"{name}/with"] = attempt(train, **kwargs)
    results["two/with"] = attempt(two_engines)
    results["stats"] = dict(zeroshim.stats("gas_output_scaling"))
    end(out, results)


if __name__ == "__main__":
    main()
