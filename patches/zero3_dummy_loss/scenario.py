"""Scenario for patch ``zero3_dummy_loss``.

``dummy = <sum over adapter parameters> * <zero>`` added to the loss, in every
combination of: adapter used in the forward or not; term built inside the
model's forward or outside it; zero written ``0.0``, ``0`` or
``torch.tensor(0.)``.  Reference: the same model and batch without the dummy
line.  Phases in one process per rank: without zeroshim (reference and
failing runs; only ``zero3_gloo_gather`` on, by its own gate, see below), with
zeroshim (ZeRO-3 runs; ZeRO-2 and ZeRO-0 runs with the dummy, patched and
unpatched, must be identical and strip nothing).
"""


import torch
import torch.nn as nn

from common import (attempt, ds_config, enable_zeroshim, end, import_deepspeed, init_distributed, param_digest, versions)

# zero3_gloo_gather kept on in the runs without zeroshim (it follows its own gate, DeepSpeed < 0.19.8): the
# default-threshold runs gather their persistent parameters with DeepSpeed's blocking gather after every step and
# are compared bit for bit, which on gloo now and then reads unwritten memory (see common.import_deepspeed)
deepspeed = import_deepspeed(fix_gloo_gathers=True)
STEPS = 2
ZEROS = {"0.0": lambda: 0.0, "0": lambda: 0, "tensor": lambda: torch.tensor(0.)}
PLACEMENTS = ("used_inside", "used_outside", "unused_inside", "unused_outside")


def dummy_term(module, zero):
    return sum(p.sum() for p in module.adapter.parameters()) * zero


class Net(nn.Module):
    def __init__(self, use_adapter: bool, zero=None):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.adapter = nn.Sequential(nn.Linear(16, 4, bias=False), nn.Linear(4, 16))  # LoRA-like
        self.head = nn.Linear(16, 1)
        self.use_adapter, self.zero = use_adapter, zero

    def forward(self, x):
        h = self.body(x)
        if self.use_adapter:
            h = h + self.adapter(h)
        loss = self.head(h).float().pow(2).mean()
        if self.zero is not None:
            loss = loss + dummy_term(self, self.zero)
        return loss


# Further forms of the term (issue #15); each added outside the forward to the model's loss.
def _params(engine):
    return list(engine.module.adapter.parameters())


FORMS = {
    # engine.backward(loss=...) as a keyword
    "keyword": (lambda engine, out: sum(p.sum() for p in _params(engine)) * 0.0, {"keyword": True}),
    # a mixed term: part through the model (DeepSpeed's hooks), part over the raw parameters
    "mixed": (lambda engine, out: (out * 1.0 + sum(p.sum() for p in _params(engine))) * 0.0, {}),
    # per-parameter weights computed at run time, all zero this step
    "runtime_weights": (lambda engine, out: (torch.stack([p.sum() for p in _params(engine)])
                                             * torch.zeros(len(_params(engine)))).sum(), {}),
    # mean of the empty placeholder: the term's value is NaN
    "mean": (lambda engine, out: sum(p.mean() for p in _params(engine)) * 0.0, {}),
    # torch.mul, which zeroshim does not watch: the first backward's walk finds the term, and the engine walks
    "torch_mul": (lambda engine, out: torch.mul(sum(p.sum() for p in _params(engine)), 0.0), {}),
}


def train_form(form, stage=3) -> dict:
    term, opts = FORMS[form]
    torch.manual_seed(0)
    model = Net(use_adapter=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, bf16=stage > 0))
    gen = torch.Generator().manual_seed(10 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen).to(engine.module.body.weight.dtype)
        out = engine(x)
        loss = out + term(engine, out)
        if opts.get("keyword"):
            engine.backward(loss=loss)
        else:
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, **param_digest(engine)}


def train_whole_loss_zero(stage) -> dict:
    """``loss * 0.0`` (skipping a batch): reaches the parameters only through
    DeepSpeed's module hooks, where they were gathered; must not be touched."""
    torch.manual_seed(0)
    model = Net(use_adapter=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).to(engine.module.body.weight.dtype)
    engine.backward(engine(x) * 0.0)
    engine.step()
    return param_digest(engine)


def train(stage, placement, zero_name=None) -> dict:
    torch.manual_seed(0)
    zero = ZEROS[zero_name]() if zero_name else None
    inside = zero is not None and placement.endswith("inside")
    model = Net(use_adapter=placement.startswith("used"), zero=zero if inside else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, bf16=stage > 0))
    gen = torch.Generator().manual_seed(10 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen).to(engine.module.body.weight.dtype)
        loss = engine(x)
        if zero is not None and not inside:
            loss = loss + dummy_term(engine.module, zero)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, **param_digest(engine)}


def default_threshold_config(stage=3, **zero) -> dict:
    """``ds_config`` with DeepSpeed's own ``stage3_param_persistence_threshold``
    (1e5 elements: every parameter here is persistent, gathered at its first use
    and kept) unless ``zero`` names one."""
    cfg = ds_config(stage, bf16=True, **zero)
    if "stage3_param_persistence_threshold" not in zero:
        cfg["zero_optimization"].pop("stage3_param_persistence_threshold", None)
    return cfg


def train_default_threshold(with_term: bool) -> dict:
    """The adapter never used, a zero term over it, DeepSpeed's default
    persistence threshold: persistent parameters are placeholders until their
    first gather, so the term still records shape [0]."""
    torch.manual_seed(0)
    model = Net(use_adapter=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=default_threshold_config())
    gen = torch.Generator().manual_seed(10 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen).to(engine.module.body.weight.dtype)
        loss = engine(x)
        if with_term:
            loss = loss + dummy_term(engine.module, 0.0)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, **param_digest(engine)}


def train_gathered(kind: str) -> dict:
    """Terms over parameters that are gathered when the term is built.  Step 0
    runs the adapter on every rank (its persistent parameters are gathered then
    and kept); later steps leave it out of the forward and add a term instead:

    * ``rank_weight``: ``sum(p.sum()) * w`` over the (gathered) adapter with a
      per-rank weight, 0 on rank 0 and 1 on the others: no bug, it trains
      upstream (every rank reduces the adapter); must be left as it is;
    * ``mixed``: rank 0 adds ``(adapter[0].weight.sum() + adapter[1].bias.sum())
      * 0`` -- a partitioned placeholder (the bug) and a gathered parameter --
      while the other ranks add ``adapter[1].bias.sum() * 1``, so every rank
      must reduce ``adapter[1].bias``;
    * ``mixed_reference``: as ``mixed``, rank 0's term without the placeholder.
    """
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = Net(use_adapter=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # mixed: small tensors (the biases) persist, the adapter's weights are partitioned; no prefetching,
    # because the module order changes after step 0 (DeepSpeed < 0.15.3 then fails with "still have
    # inflight params" without zeroshim: patch zero3_inflight_params, not this one)
    zero = {} if kind == "rank_weight" else {"stage3_param_persistence_threshold": 20,
                                             "stage3_prefetch_bucket_size": 0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=default_threshold_config(**zero))
    gen = torch.Generator().manual_seed(10 + rank)
    adapter = engine.module.adapter
    losses = []
    for step in range(STEPS + 1):
        engine.module.use_adapter = step == 0
        x = torch.randn(4, 8, generator=gen).to(engine.module.body.weight.dtype)
        loss = engine(x)
        if step:
            if kind == "rank_weight":
                loss = loss + dummy_term(engine.module, torch.tensor(float(rank > 0)))
            elif rank > 0:
                loss = loss + adapter[1].bias.sum() * 1.0
            elif kind == "mixed":
                loss = loss + (adapter[0].weight.sum() + adapter[1].bias.sum()) * 0.0
            else:
                loss = loss + adapter[1].bias.sum() * 0.0
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, **param_digest(engine)}


def train_plain_backward() -> dict:
    """``loss.backward()`` instead of ``engine.backward(loss)`` (DeepSpeed >= 0.18
    accepts it under ZeRO): the walk runs in ``engine.backward`` only."""
    torch.manual_seed(0)
    model = Net(use_adapter=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(3, bf16=True))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).to(engine.module.body.weight.dtype)
    (engine(x) + dummy_term(engine.module, 0.0)).backward()
    engine.step()
    return param_digest(engine)


# Releases that run plain tensor.backward() under ZeRO (the engine hooks its forward output to finish the backward)
PLAIN_BACKWARD = hasattr(deepspeed.runtime.engine.DeepSpeedEngine, "_backward_post_hook")
GATHERED = ("rank_weight", "mixed", "mixed_reference")


def main():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--zeros", default=",".join(ZEROS), help="the spellings of zero to run (comma-separated)")
    parser.add_argument("--forms", default=",".join(FORMS), help="the further forms of the term to run "
                                                                 "(comma-separated; '' for none)")
    parser.add_argument("--untouched-stages", default="0,2", help="the ZeRO stages below 3 whose runs must be "
                                                                   "left untouched (comma-separated; '' for none)")
    args = parser.parse_args()
    zeros = [z for z in args.zeros.split(",") if z]
    forms = [f for f in args.forms.split(",") if f]
    stages = [int(z) for z in args.untouched_stages.split(",") if z]
    for given, valid, flag in ((zeros, ZEROS, "--zeros"), (forms, FORMS, "--forms")):
        unknown = set(given) - set(valid)
        if unknown:
            parser.error(f"unknown {flag} {sorted(unknown)}; valid: {', '.join(valid)}")
    if set(stages) - {0, 1, 2}:
        parser.error("--untouched-stages takes stages 0, 1 and 2")
    init_distributed()
    out, results = args.out, {"versions": versions()}
    for used in ("used", "unused"):
        results[f"reference/{used}"] = attempt(train, 3, f"{used}_inside")
    for placement in PLACEMENTS:
        for zero in zeros:
            results[f"without/{placement}/{zero}"] = attempt(train, 3, placement, zero)
    for stage in stages:
        results[f"z{stage}/without"] = attempt(train, stage, "unused_outside", "0.0")
    results["whole_loss_zero/without"] = attempt(train_whole_loss_zero, 3)
    for form in forms:
        results[f"form/without/{form}"] = attempt(train_form, form)
    results["default/reference"] = attempt(train_default_threshold, False)
    results["default/without"] = attempt(train_default_threshold, True)
    results["gathered/without/rank_weight"] = attempt(train_gathered, "rank_weight")
    results["gathered/reference/mixed"] = attempt(train_gathered, "mixed_reference")

    zeroshim = enable_zeroshim()

    def counted(key, fn, *args):
        """Run ``fn(*args)`` with zeroshim; the run's share of the patch's counters: terms cut ("stripped"),
        gradients zero-filled, NaN losses seen, backwards that walked the whole graph and that took the terms
        noted when they were built."""
        names = {"stripped": "stripped", "zero_filled": "zero_filled", "nan_warned": "nan_loss_seen",
                 "walked": "backward_calls_walked", "noted": "backward_calls_noted"}
        before = dict(zeroshim.stats("zero3_dummy_loss"))
        run = attempt(fn, *args)
        after = zeroshim.stats("zero3_dummy_loss")
        run.update({key_: after[name] - before[name] for key_, name in names.items()})
        results[key] = run

    results["status"] = {k: v.as_dict() for k, v in zeroshim.status().items()}
    for placement in PLACEMENTS:
        for zero in zeros:
            counted(f"with/{placement}/{zero}", train, 3, placement, zero)
    for stage in stages:
        counted(f"z{stage}/with", train, stage, "unused_outside", "0.0")
    counted("whole_loss_zero/with", train_whole_loss_zero, 3)
    for form in forms:
        counted(f"form/with/{form}", train_form, form)

    counted("default/with", train_default_threshold, True)
    for kind in ("rank_weight", "mixed"):
        counted(f"gathered/with/{kind}", train_gathered, kind)
    if PLAIN_BACKWARD:
        counted("plain_backward/with", train_plain_backward)
    end(out, results)


if __name__ == "__main__":
    main()
