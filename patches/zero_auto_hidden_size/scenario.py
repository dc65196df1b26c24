"""Scenario for patch ``zero_auto_hidden_size``: a plain accelerate loop
(``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))``,
``accelerator.prepare(model, optimizer, dataloader)``) whose ZeRO-3 config
leaves the three hidden-size-based entries ``"auto"``, on a tiny
``LlavaForConditionalGeneration`` (Llama text model, hidden 16; CLIP vision
tower, frozen): its ``LlavaConfig`` has ``text_config.hidden_size`` and no
``hidden_size``.  fp32, AdamW, 4 steps of 2 token sequences per rank.

Runs, in one process per rank:

* ``reference``: the three values written by hand (256, 230, 160: what
  ``hidden * hidden``, ``int(0.9 * hidden * hidden)``, ``10 * hidden`` give
  for hidden 16), no zeroshim;
* ``text/without``: a Llama text model (top-level ``hidden_size``) with the
  "auto" entries, no zeroshim (accelerate fills them itself);
* ``without``: the LLaVA model with the "auto" entries, no zeroshim
  (accelerate >= 0.26.0: "Can find neither `model.config.hidden_size` ...");
* ``with``: the same with zeroshim (trains as the reference);
* ``explicit/with``: the reference's config (numbers by hand) with zeroshim
  (nothing filled, same numbers);
* ``text/with``: the text model with zeroshim (untouched: same numbers as
  ``text/without``);

plus ``filled`` (what the patch filled) and, per run, ``zero`` (the three
values in the config the engine got) and ``user_config`` (the plugin config
as the caller sees it afterwards).
"""

import torch

from common import attempt, begin, enable_zeroshim, end, import_deepspeed, param_digest

import_deepspeed(fix_gloo_gathers=True)  # ZeRO-3 gathers compared bit for bit (see common.import_deepspeed)
from tiny_llava import BY_HAND, KEYS, MICRO, SEQ, STEPS, VOCAB, build, ds_config  # noqa: E402,F401


def train(kind: str, auto: bool) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)  # one Accelerator per run (accelerate keeps its state in singletons)
    GradientState._reset_state()
    model = build(kind)
    config = ds_config(auto)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(100)
    data = [torch.randint(0, VOCAB - 1, (SEQ,), generator=gen) for _ in range(STEPS * MICRO * 2)]
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, ids in enumerate(loader):
        if step == STEPS:
            break
        loss = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    zc = engine._config.zero_config  # what the engine runs with
    user = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
    return {"losses": losses, **param_digest(engine),
            "zero": [zc.reduce_bucket_size, zc.prefetch_bucket_size, zc.param_persistence_threshold],
            "user_config": {k: user.get(k) for k in KEYS}}


def main():
    out, results = begin()
    results["reference"] = attempt(train, "llava", False)
    results["text/without"] = attempt(train, "text", True)
    results["without"] = attempt(train, "llava", True)

    zeroshim = enable_zeroshim()

    results["status"] = zeroshim.status()["zero_auto_hidden_size"].as_dict()
    results["with"] = attempt(train, "llava", True)
    filled_by_with = len(zeroshim.stats("zero_auto_hidden_size")["filled"])
    results["explicit/with"] = attempt(train, "llava", False)
    results["text/with"] = attempt(train, "text", True)
    results["filled"] = [list(f) for f in zeroshim.stats("zero_auto_hidden_size")["filled"]]
    results["filled_by_with"] = filled_by_with
    end(out, results)


if __name__ == "__main__":
    main()
