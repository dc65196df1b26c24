"""Scenario for patch ``zero3_unwrapped_model``: a tiny Llama built with ``from_config`` while a ZeRO-3
``HfDeepSpeedConfig`` is active (as a teacher or reference model is), then called, 2 ranks.

Runs, in one process per rank (``stage3_param_persistence_threshold`` 0 unless said otherwise):

* ``without``: called as it is, no zeroshim: ``RuntimeError: 'weight' must be 2-D``;
* ``with``: the same with zeroshim: ``UnwrappedZero3Model`` naming the cause and the remedies;
* ``engine/without``, ``engine/with``: passed to ``deepspeed.initialize`` (no optimizer) first: the logits of
  both runs equal bit for bit;
* ``gathered/without``, ``gathered/with``: called inside ``GatheredParameters``: equal bit for bit;
* ``default/without``, ``default/with``: as ``without`` and ``with`` under DeepSpeed's default persistence
  threshold (``zero.Init`` partitions every parameter whatever the threshold; the engine applies it): the same
  two errors.
"""

import hashlib

import torch

from common import attempt, begin, enable_zeroshim, end, import_deepspeed

# the gathered runs take DeepSpeed's blocking gather of every parameter: on gloo before 0.19.8 it reads unwritten
# memory now and then (zero3_gloo_gather), which the comparison would measure (a rehearsal on 0.16.9 once did)
deepspeed = import_deepspeed(fix_gloo_gathers=True)


def run(how: str, threshold: "int | None" = 0) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    zero = {"stage": 3} if threshold is None else {"stage": 3, "stage3_param_persistence_threshold": threshold}
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (transformers keeps a weak reference)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.eval()
    ids = torch.tensor([[1, 5, 9, 17, 3]])
    with torch.no_grad():
        if how == "engine":
            engine, *_ = deepspeed.initialize(model=model, config=ds_config)
            logits = engine(input_ids=ids).logits
        elif how == "gathered":
            with deepspeed.zero.GatheredParameters(list(model.parameters())):
                logits = model(input_ids=ids).logits
        else:
            logits = model(input_ids=ids).logits
    del keep
    return {"logits_sha256": hashlib.sha256(logits.float().contiguous().numpy().tobytes()).hexdigest()}


def main():
    out, results = begin()
    results["without"] = attempt(run, "plain")
    results["engine/without"] = attempt(run, "engine")
    results["gathered/without"] = attempt(run, "gathered")
    results["default/without"] = attempt(run, "plain", None)

    zeroshim = enable_zeroshim()
    # the runs differ only by this patch: on transformers 4.52-5.2 zero3_from_config_init would give the model
    # built with zeroshim its own initialisation, and the calls that work other logits
    zeroshim.unpatch("zero3_from_config_init")

    results["status"] = zeroshim.status()["zero3_unwrapped_model"].as_dict()
    results["with"] = attempt(run, "plain")
    results["engine/with"] = attempt(run, "engine")
    results["gathered/with"] = attempt(run, "gathered")
    results["default/with"] = attempt(run, "plain", None)
    results["stats"] = dict(zeroshim.stats("zero3_unwrapped_model"))
    end(out, results)


if __name__ == "__main__":
    main()
