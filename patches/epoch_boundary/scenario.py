"""Scenario for patch ``epoch_boundary``.

ZeRO-3 with ``offload_optimizer`` and ``offload_param`` (CPU), bf16, a small
language-model-like stack with one frozen block (LoRA-like), several epochs
over a DataLoader that is re-iterated every epoch (one worker process, as
Trainer users often configure).  Phases in one process per rank:

* without zeroshim: the reference runs (custom loop over a torch DataLoader;
  the dataset given to ``deepspeed.initialize`` and its DeepSpeedDataLoader
  iterated every epoch);
* with zeroshim: the custom loop calling ``zeroshim.epoch_boundary(engine)``
  after every epoch, with some parameters left gathered on purpose before the
  call (what must be released), recording gathered-parameter counts and RSS;
  and the DeepSpeedDataLoader loop, where the boundary must fire by itself;
* RLHF-like, without and with zeroshim: an "actor" engine trained over its
  own training loader next to a "reference" ZeRO-3 engine used only for
  forwards, parameters of both left gathered at every epoch end.  The
  actor's loader re-iterated must release the actor's parameters only; an
  evaluation loader of ``engine.deepspeed_io`` iterated twice on rank 0 only,
  and a look at one training batch on rank 0 only before training, must
  release nothing; and after training, HF Trainer's ``on_epoch_begin`` with
  the actor's module as its model releases the actor's parameters only, with
  a model no engine wraps nothing.
"""

import torch
import torch.nn as nn

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest

deepspeed = import_deepspeed()
EPOCHS, STEPS, MICRO, SEQ, VOCAB = 3, 3, 2, 16, 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))


class LM(nn.Module):
    def __init__(self, hidden=32, layers=3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(),
                                                  nn.Linear(2 * hidden, hidden)) for _ in range(layers))
        self.out = nn.Linear(hidden, VOCAB)
        self.blocks[0].requires_grad_(False)  # frozen base block

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.out(h[:, :-1]).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def config():
    cfg = ds_config(3, micro_batch=MICRO, clip=1.0,
                    offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW: no CPU Adam JIT build in tests
    return cfg


def gathered(engine) -> int:
    return sum(1 for p in engine.module.parameters() if p.ds_status.name == "AVAILABLE")


def build(ds_loader: bool):
    torch.manual_seed(0)
    model = LM()
    cfg = config()
    data = Tokens(MICRO * torch.distributed.get_world_size() * STEPS)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if ds_loader:
        cfg["dataloader_drop_last"] = True
        engine, _, loader, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, training_data=data)
        loader.num_local_io_workers = 1
    else:
        sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler, num_workers=1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine, loader


def train(ds_loader=False, boundary=None, leave_gathered=False) -> dict:
    engine, loader = build(ds_loader)
    losses, epochs = [], []
    for epoch in range(EPOCHS):
        getattr(loader, "data_sampler", getattr(loader, "sampler", None)).set_epoch(epoch)
        for ids in loader:
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        record = {"gathered_at_end": gathered(engine)}
        if leave_gathered:  # what the patch must release: parameters left gathered after the step
            params = list(engine.module.out.parameters()) + list(engine.module.blocks[0].parameters())
            params[0].all_gather(param_list=params)
            record["gathered_before_boundary"] = gathered(engine)
        if boundary is not None:
            record["freed"] = boundary(engine)
            record["gathered_after_boundary"] = gathered(engine)
        epochs.append(record)
    return {"losses": losses, "epochs": epochs, **param_digest(engine)}


def leave_gathered(engine) -> int:
    """Gather some parameters of ``engine`` by hand and leave them gathered (what an epoch boundary
    should release); the number of its parameters gathered then."""
    params = list(engine.module.out.parameters()) + list(engine.module.blocks[0].parameters())
    params[0].all_gather(param_list=params)
    return gathered(engine)


def rlhf(zeroshim=None) -> dict:
    """The actor trained with its training loader, the reference engine only forwarding (RLHF)."""
    rank = torch.distributed.get_rank()
    actor, loader = build(ds_loader=True)
    torch.manual_seed(1)
    ref_cfg = config()
    del ref_cfg["zero_optimization"]["offload_optimizer"]  # as TRL prepares a reference model: no optimizer
    reference, *_ = deepspeed.initialize(model=LM(), config=ref_cfg)
    reference.eval()
    # a loader of no engine's training data (evaluation)
    evaluation = actor.deepspeed_io(Tokens(2 * MICRO), route="eval", num_local_io_workers=0)
    boundaries = (lambda: zeroshim.stats("epoch_boundary")["boundaries"]) if zeroshim else (lambda: 0)
    start = boundaries()
    if rank == 0:
        next(iter(loader))  # a look at a batch on rank 0 only: no epoch
    losses, ref_losses, epochs = [], [], []
    for epoch in range(EPOCHS):
        loader.data_sampler.set_epoch(epoch)
        it = iter(loader)  # from the second epoch on: the actor's epoch boundary
        record = {"actor_after_iter": gathered(actor), "reference_after_iter": gathered(reference)}
        for ids in it:
            with torch.no_grad():
                ref_losses.append(reference(ids).item())
            loss = actor(ids)
            actor.backward(loss)
            actor.step()
            losses.append(loss.item())
        record["actor_left"], record["reference_left"] = leave_gathered(actor), leave_gathered(reference)
        epochs.append(record)
    result = {"losses": losses, "ref_losses": ref_losses, "epochs": epochs,
              "automatic_boundaries": boundaries() - start, **param_digest(actor),
              "reference": param_digest(reference)}
    if rank == 0:  # an evaluation loader iterated twice on one rank, parameters left gathered: no epoch
        before = {"actor": gathered(actor), "reference": gathered(reference)}
        for _ in range(2):
            for _batch in evaluation:
                pass
        result["eval_reiterated"] = {"before": before, "after": {"actor": gathered(actor),
                                                                 "reference": gathered(reference)}}
    for engine in (actor, reference):  # every rank the same state again (rank 0 may have released)
        engine.empty_partition_cache()
    if zeroshim is not None:  # HF Trainer's epoch begin, on every rank, after training
        import transformers.trainer_callback as tc

        state, control = tc.TrainerState(), tc.TrainerControl()
        state.epoch = float(EPOCHS)
        trainer = {}
        for name, model in (("actor", actor.module), ("unrelated", LM())):
            before = {"actor": leave_gathered(actor), "reference": leave_gathered(reference)}
            tc.CallbackHandler([], model, None, None, None).on_epoch_begin(None, state, control)
            trainer[name] = {"before": before, "after": {"actor": gathered(actor), "reference": gathered(reference)}}
        result["trainer_epoch_begin"] = trainer
    for engine in (actor, reference):  # every rank the same state before the next run
        engine.empty_partition_cache()
    return result


def main():
    out, results = begin()
    results["reference/custom"] = attempt(train)
    results["reference/ds_loader"] = attempt(train, ds_loader=True)
    results["reference/rlhf"] = attempt(rlhf)

    zeroshim = enable_zeroshim()
    import transformers.trainer_callback  # noqa: F401  (every target of the patch imported: "applied")

    results["status"] = {k: v.as_dict() for k, v in zeroshim.status().items()}
    results["explicit"] = attempt(train, boundary=zeroshim.epoch_boundary, leave_gathered=True)
    before = zeroshim.stats("epoch_boundary")["boundaries"]
    run = attempt(train, ds_loader=True)
    run["automatic_boundaries"] = zeroshim.stats("epoch_boundary")["boundaries"] - before
    results["automatic/ds_loader"] = run
    results["automatic/rlhf"] = attempt(rlhf, zeroshim)
    # The DataLoader is re-iterated, but the patch is off: nothing may happen.
    zeroshim.configure(epoch_boundary="off")
    before = zeroshim.stats("epoch_boundary")["boundaries"]
    run = attempt(train, ds_loader=True)
    run["automatic_boundaries"] = zeroshim.stats("epoch_boundary")["boundaries"] - before
    results["off/ds_loader"] = run
    end(out, results)


if __name__ == "__main__":
    main()
