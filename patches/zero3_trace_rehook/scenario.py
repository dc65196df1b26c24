"""Scenario for patch ``zero3_trace_rehook``: a tiny Llama with peft LoRA (r=4 on q_proj/v_proj) under ZeRO-3,
2 ranks, fp32, SGD; each of 3 iterations generates 3 tokens through an unwrap-for-generation helper
(DeepSpeed's ``unwrap_model_for_generation`` where the release has it, 0.16 on; before, the same hook removal
and registration TRL's helper does), then trains one step, as an RL rollout loop does.

Runs, in one process per rank:

* ``reference``: the same 3 training steps without generating (generation changes no parameter);
* ``without``: generate and train, no zeroshim (DeepSpeed < 0.19.2: ``IndexError: pop from an empty deque``
  at the end of the second step);
* ``with``: the same with zeroshim: the losses and the parameters equal the reference's bit for bit;
* ``plain/without``, ``plain/with``: the model without LoRA, which trains on without zeroshim: the two runs
  must be equal bit for bit (the patch acts there, and changes only which collectives run).
"""

import contextlib

import torch

from common import attempt, begin, ds_config, enable_zeroshim, end, import_deepspeed, param_digest, tiny_llama

deepspeed = import_deepspeed(fix_gloo_gathers=True)  # generation and training gather; compared bit for bit
ITERATIONS, SEQ, NEW = 3, 6, 3


@contextlib.contextmanager
def unwrap(engine):
    """The full model for generation, its ZeRO-3 hooks removed, registered again on exit."""
    from deepspeed.runtime.zero import stage3

    helper = getattr(stage3, "unwrap_model_for_generation", None)
    if helper is not None:
        with helper(engine) as model:
            yield model
        return
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)  # as TRL's helper, 0.14
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        yield engine.module
        offload._register_hooks_recursively(offload.module)


def train(lora: bool, generate: bool) -> dict:
    model = tiny_llama()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trained, lr=0.1),
                                      config=ds_config(3, micro_batch=1, bf16=False))
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    losses, generated = [], []
    for _ in range(ITERATIONS):
        ids = torch.randint(3, 64, (1, SEQ), generator=gen)
        if generate:
            with unwrap(engine) as unwrapped, torch.no_grad():
                out = unwrapped.generate(input_ids=ids[:, :3], max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                         eos_token_id=None)
            generated.append(out[0].tolist())
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "generated": generated, **param_digest(engine)}


def main():
    out, results = begin()
    results["reference"] = attempt(train, True, False)
    results["without"] = attempt(train, True, True)
    results["plain/without"] = attempt(train, False, True)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero3_trace_rehook"].as_dict()
    results["with"] = attempt(train, True, True)
    results["plain/with"] = attempt(train, False, True)
    results["stats"] = dict(zeroshim.stats("zero3_trace_rehook"))
    end(out, results)


if __name__ == "__main__":
    main()
