"""Fill ``"auto"`` ZeRO bucket sizes from ``config.text_config`` for multimodal models in ``accelerator.prepare``.

Symptom
    ``accelerator.prepare(model, optimizer, dataloader)`` with a DeepSpeed
    config holding ``"reduce_bucket_size": "auto"``,
    ``"stage3_prefetch_bucket_size": "auto"`` or
    ``"stage3_param_persistence_threshold": "auto"`` (the usual ``zero3.json``)
    refuses a multimodal model (LLaVA, Idefics2/3, Mllama, Gemma 3, Mistral 3,
    Llama 4, InternVL, Qwen3-VL; Qwen2-VL and Qwen2.5-VL from transformers 5)::

        ValueError: Can find neither `model.config.hidden_size` nor `model.config.hidden_sizes`,
        therefore it's not possible to automatically fill out the following `auto` entries in the
        DeepSpeed config file: ['zero_optimization.reduce_bucket_size', ...]. You can fix that by
        replacing `auto` values for these keys with an integer value of your choice.

    The same config trains the same model under HF Trainer (transformers >=
    4.46, which fills these entries itself); LLaMA-Factory#4754 is the
    Trainer-side report of the same limitation on older transformers.

Cause
    Both transformers (``HfTrainerDeepSpeedConfig.trainer_config_finalize``)
    and accelerate (``Accelerator._prepare_deepspeed``) fill these three
    values from the model's hidden size: ``hidden * hidden``,
    ``int(0.9 * hidden * hidden)`` and ``10 * hidden``.  A multimodal config
    keeps the language model's ``hidden_size`` in ``config.text_config`` and
    has none at the top level.  transformers 4.46.0 (huggingface/transformers
    #33829, for Mllama) falls back to ``text_config.hidden_size`` /
    ``text_config.hidden_sizes``; accelerate looks only at ``hidden_size`` and
    ``hidden_sizes`` and raises.  A plain accelerate loop (or anything else
    that calls ``accelerator.prepare`` with the "auto" entries still in the
    plugin's config) fails; HF Trainer fills them itself before accelerate
    sees them.

Affected versions
    accelerate >= 0.26.0 (every release since, up to 1.15.0, the newest),
    read in the released wheels: 0.26.0, 0.26.1, 0.27.0, 0.27.2, 0.29.3,
    0.30.1, 0.33.0, 0.34.0, 0.34.2, 1.0.0, 1.14.0 and the installed 1.15.0
    raise the error above and mention ``text_config`` nowhere in
    ``accelerator.py``; 0.25.0 (0.12.0, 0.13.2, 0.14.0, 0.15.0, 0.20.3 and
    0.21.0 read likewise) has no such raise: without a ``hidden_size`` it
    leaves the "auto" entries in place and its ``DeepSpeedPlugin.fill_match``
    then raises "`zero_optimization.reduce_bucket_size` not found in kwargs"
    (read, not run; not handled here).  The source fingerprint is that raise in a file that never
    mentions ``text_config``.  Not affected: HF Trainer on transformers >=
    4.46.0 with a ZeRO-3 config (it fills the ``stage3_*`` entries only when
    the config is ZeRO-3, so a ZeRO-1/2 config that keeps them "auto" still
    reaches accelerate's check: read in 4.57 and accelerate 1.15, not run; the
    patch fills them there too) (4.46.0, 4.46.3, 4.48.3, 4.49.0, 4.57.6, 5.0.0, 5.23.0, 5.24.0 read;
    4.45.2 and older raise "The model's config file has neither
    `hidden_size` nor `hidden_sizes` entry" in Trainer itself, before
    accelerate: not handled here).  Which models lack a top-level
    ``hidden_size`` was measured on the installed config classes:
    Qwen2-VL/Qwen2.5-VL have one in 4.49 and 4.57 but not in 5.23.

Flag
    ``ZEROSHIM_ZERO_AUTO_HIDDEN_SIZE=auto|on|off`` (default ``auto``).

Fix
    ``Accelerator._prepare_deepspeed`` is wrapped.  Before it runs, where the
    model it will prepare (the last ``torch.nn.Module`` among the arguments,
    as accelerate picks it) has a ``config`` with neither ``hidden_size`` nor
    ``hidden_sizes`` but a ``text_config`` with one of them, each of the
    three entries that is still ``"auto"`` in the active plugin's config is
    filled with the value transformers' own fallback gives (the text model's
    ``hidden_size``, else the largest of its ``hidden_sizes``; ``hidden *
    hidden``, ``int(0.9 * hidden * hidden)``, ``10 * hidden``), in the
    plugin's config dict, as accelerate fills it.  Numbers the user wrote,
    models with a top-level hidden size and configs without a text
    hidden size are left alone (accelerate's own behaviour, error
    included).  One INFO line per job (it acts only where accelerate would fail) (the values, why,
    the flag).

Undo
    ``zeroshim.unpatch("zero_auto_hidden_size")`` restores ``Accelerator._prepare_deepspeed``.

Evidence
    benchmarks/RESULTS.md, "Moved from the patch docstrings", ``zero_auto_hidden_size``.
"""

from __future__ import annotations

from zeroshim import _log
from zeroshim._core import Patch, is_active
from zeroshim._patcher import Patcher, guard, require_attr
from zeroshim._source import Fingerprint

NAME = "zero_auto_hidden_size"
#: filled: ("zero_optimization.<key>", value) for each "auto" entry filled, in order;
#: hidden: the text hidden size each fill used (one per prepare that filled)
stats = {"filled": [], "hidden": []}
KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold")


def _sizes(hidden: int) -> dict:
    """The values transformers and accelerate both give the three keys (DeepSpeed's tuning guidance)."""
    return dict(zip(KEYS, (hidden * hidden, int(0.9 * hidden * hidden), 10 * hidden)))


def _text_hidden_size(config):
    """The text model's hidden size where ``config`` itself has none, as transformers >= 4.46 finds it; else None."""
    if config is None or hasattr(config, "hidden_size") or hasattr(config, "hidden_sizes"):
        return None  # accelerate reads these itself
    text = getattr(config, "text_config", None)
    if text is None:
        return None
    if hasattr(text, "hidden_size"):
        hidden = text.hidden_size
    elif hasattr(text, "hidden_sizes"):
        hidden = max(text.hidden_sizes)
    else:
        return None
    return hidden if type(hidden) is int and hidden > 0 else None


def _plugin(accelerator):
    plugin = getattr(accelerator, "deepspeed_plugin", None)
    if plugin is None:
        plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return plugin


def _fill(accelerator, args) -> None:
    import torch  # noqa: PLC0415 (imported by accelerate already)

    models = [obj for obj in args if isinstance(obj, torch.nn.Module)]
    plugin = _plugin(accelerator)
    hf_config = getattr(plugin, "hf_ds_config", None)
    if not models or hf_config is None:
        return
    auto = []
    for key in KEYS:
        node, leaf = hf_config.find_config_node(key)
        if node is not None and node.get(leaf) == "auto":
            auto.append((key, node, leaf))
    if not auto:
        return
    hidden = _text_hidden_size(getattr(models[-1], "config", None))
    if hidden is None:
        return
    sizes = _sizes(hidden)
    for key, node, leaf in auto:
        node[leaf] = sizes[key]
        stats["filled"].append((key, sizes[key]))
    stats["hidden"].append(hidden)
    _log.acted(NAME, "filled the \"auto\" entries %s from the model's text_config.hidden_size=%d",
               "the model's config (%s) has no top-level hidden_size and accelerate's DeepSpeed preparation reads "
               "only that (transformers' Trainer falls back to text_config the same way)",
               ", ".join(f"{key}={sizes[key]}" for key, _, _ in auto), hidden, type(models[-1].config).__name__)


def _prepare_deepspeed(wrapped, instance, args, kwargs):
    """Wraps ``Accelerator._prepare_deepspeed(*args)``."""
    with guard(NAME):
        if instance is not None and is_active(NAME):
            _fill(instance, args)
    return wrapped(*args, **kwargs)


def patch_accelerator(module, patcher: Patcher) -> None:
    cls = require_attr(module, "Accelerator")
    require_attr(cls, "_prepare_deepspeed")
    patcher.wrap(cls, "_prepare_deepspeed", _prepare_deepspeed)


PATCH = Patch(
    changes=('error',),
    name=NAME,
    summary="accelerator.prepare with \"auto\" ZeRO bucket sizes on a multimodal model (hidden size only in "
            "text_config): \"Can find neither `model.config.hidden_size` nor `model.config.hidden_sizes`\"",
    signatures=(r"Can find neither `model\.config\.hidden_size` nor `model\.config\.hidden_sizes`",),
    versions_note=("accelerate's own DeepSpeed preparation; HF Trainer ≥ 4.46 fills them itself at ZeRO-3"),
    affects={"accelerate": ">=0.26.0"},
    fingerprint=Fingerprint("accelerate.accelerator",
                            r"(?s)\A(?!.*\btext_config\b).*Can find neither `model\.config\.hidden_size`",
                            "accelerate's hidden-size error for \"auto\" bucket sizes, in an accelerator.py that "
                            "never reads text_config"),
    targets={"accelerate.accelerator": patch_accelerator},
)
