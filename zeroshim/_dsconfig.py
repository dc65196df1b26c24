"""A DeepSpeed config as ``zeroshim doctor --config`` reads it.

:func:`read` turns the JSON object into a :class:`DSConfig` with the few
values the checks need, read the way DeepSpeed reads them (its pydantic models
accept ``"3"`` for 3 and ``"true"`` for True; HF Trainer's ``"auto"`` values
are left as ``"auto"``), and a list of problems with the config's shape
(a section that is not an object, a stage that is not 0-3).  It never raises
for a bad config: the problems are findings.

Patches declare their own checks (``Patch.check_config``); the ones here are
about the config alone (offload settings that cannot work together).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Optional

AUTO = "auto"
NONE_DEVICES = (None, "none")


class DSConfig:
    """What the checks read from a DeepSpeed config (after :func:`read`)."""

    def __init__(self) -> None:
        self.raw: dict = {}
        self.stage = 0                         # 0-3
        self.offload_optimizer = "none"        # "none" | "cpu" | "nvme" | other string
        self.offload_param = "none"
        self.offload_sections: dict = {}       # "offload_optimizer"/"offload_param" -> dict
        self.gradient_clipping: "object" = 0.0  # float or "auto"
        self.gradient_accumulation_steps: "object" = 1  # int or "auto"
        self.zero: dict = {}

    @property
    def clipping(self) -> bool:
        clip = self.gradient_clipping
        return clip == AUTO or (isinstance(clip, (int, float)) and clip > 0)


def _number(value, kind):
    """``value`` as ``kind`` (int/float) the way pydantic's lax mode reads it, or
    ``"auto"``; None if it cannot be read."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        try:
            value = float(text)
        except ValueError:
            return None
    if isinstance(value, (int, float)):
        if kind is int:
            return int(value) if float(value).is_integer() else None
        return float(value)
    return None


def read(config: object) -> "tuple[Optional[DSConfig], List[dict]]":
    """``(DSConfig or None, problems)``; each problem is ``{"level": "error", "message"}``."""
    problems: "List[dict]" = []

    def bad(message):
        problems.append({"level": "error", "message": message, "patch": None})

    if not isinstance(config, dict):
        bad(f"the config must be a JSON object, not a JSON {type(config).__name__}.")
        return None, problems
    out = DSConfig()
    out.raw = config
    zero = config.get("zero_optimization", {})
    if zero is None:
        zero = {}
    if not isinstance(zero, dict):
        bad(f"zero_optimization must be an object, not {zero!r}.")
        zero = {}
    out.zero = zero
    stage = _number(zero.get("stage", 0), int)
    if stage is None or stage == AUTO or not 0 <= stage <= 3:
        bad(f"zero_optimization.stage must be 0, 1, 2 or 3, not {zero.get('stage')!r}.")
        stage = 0
    out.stage = stage
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if not isinstance(section, dict):
            bad(f"zero_optimization.{key} must be an object, not {section!r}.")
            section = {}
        device = section.get("device", "none")
        device = "none" if device in NONE_DEVICES else str(device).lower()
        setattr(out, key, device)
        out.offload_sections[key] = section
    clip = _number(config.get("gradient_clipping", 0.0), float)
    if clip is None:
        bad(f"gradient_clipping must be a number, not {config.get('gradient_clipping')!r}.")
        clip = 0.0
    out.gradient_clipping = clip
    ga = _number(config.get("gradient_accumulation_steps", 1), int)
    if ga is None:
        bad(f"gradient_accumulation_steps must be an integer, not {config.get('gradient_accumulation_steps')!r}.")
        ga = 1
    out.gradient_accumulation_steps = ga
    return out, problems


#: DeepSpeed's ZeRO-1/2 optimizer skips a bf16 step whose gradients hold inf or NaN by default from this release
#: (``DeepSpeedBF16Config.check_grad_overflow``: False in the 0.19.2 sdist, True in 0.19.3 and 0.19.8; #8035)
BF16_OVERFLOW_CHECK_FROM = "0.19.3"
#: ``bf16.check_grad_overflow`` exists from DeepSpeed 0.17.1 (the 0.17.0 sdist has no such key)
BF16_OVERFLOW_SETTING_FROM = "0.17.1"
#: DeepSpeed 0.17.6 (#7515) added ``DDP_BFLOAT16`` with the value of ``BFLOAT16`` ("bf16"), so its optimizer choice
#: (``in [FP16, DDP_BFLOAT16]`` before ``== BFLOAT16``) never builds BF16_Optimizer; 0.18.5 (#7790) renamed it
#: ("ddp_bf16"); read at the tags v0.17.5, v0.17.6, v0.18.2, v0.18.4, v0.18.5 (runtime/constants.py)
BF16_OPTIMIZER_UNREACHABLE = ">=0.17.6,<0.18.5"
#: DeepSpeed schedulers that give every param group the same peak rate when ``warmup_max_lr`` is one number
#: (``_format_param`` repeats it; WarmupDecayLR calls WarmupLR's ``__init__``); WarmupCosineLR scales each group's
#: own rate
ONE_PEAK_SCHEDULERS = ("WarmupLR", "WarmupDecayLR")


#: what DeepSpeed's pydantic config reads as True (lax mode), and HF's "auto" (the trainer's bf16 flag)
_TRUE = ("true", "1", "yes", "on", "y", "t", AUTO)
#: what DeepSpeed's DtypeEnum reads as fp32
_FP32 = ("fp32", "float32", "float", "torch.float32")


def _enabled(section) -> bool:
    return isinstance(section, dict) and str(section.get("enabled")).strip().lower() in _TRUE


def _fp32_accumulation(cfg: DSConfig) -> bool:
    """``data_types.grad_accum_dtype`` fp32 without optimizer offload: what asks DeepSpeed for BF16_Optimizer."""
    types = cfg.raw.get("data_types") if isinstance(cfg.raw.get("data_types"), dict) else {}
    return str(types.get("grad_accum_dtype")).strip().lower() in _FP32 and cfg.offload_optimizer in NONE_DEVICES


def _bf16_optimizer(cfg: DSConfig) -> bool:
    """Does DeepSpeed run this config with BF16_Optimizer (bf16 ZeRO-1 accumulating in fp32, no optimizer
    offload), which skips a step with an inf or NaN gradient norm whatever ``check_grad_overflow`` says?"""
    return cfg.stage == 1 and _fp32_accumulation(cfg)


def general_findings(cfg: DSConfig, deepspeed: "Optional[str]" = None) -> "List[dict]":
    """Offload settings that cannot work together, a warmup scheduler that gives every param group one peak rate,
    and a default of the installed DeepSpeed (``deepspeed``, its version; None: not installed) that changed what a
    config without the key does (no zeroshim patch involved)."""
    from . import _versions

    findings: "List[dict]" = []

    def add(level, message):
        findings.append({"level": level, "message": message, "patch": None})

    if cfg.offload_param not in NONE_DEVICES and cfg.stage != 3:
        add("error", f"offload_param={cfg.offload_param} needs ZeRO stage 3 (stage is {cfg.stage}).")
    if cfg.offload_optimizer not in NONE_DEVICES and cfg.stage == 0:
        add("error", f"offload_optimizer={cfg.offload_optimizer} needs ZeRO stage 1, 2 or 3 (stage is 0).")
    for key in ("offload_optimizer", "offload_param"):
        if getattr(cfg, key) == "nvme" and not cfg.offload_sections[key].get("nvme_path"):
            add("error", f"{key}.device is nvme but {key}.nvme_path is not set.")
    if cfg.offload_param in ("cpu", "nvme") and cfg.offload_optimizer in NONE_DEVICES:
        add("warning", f"offload_param={cfg.offload_param} without offload_optimizer: parameters are offloaded but "
                       "the larger optimizer states stay on the accelerator; usually both are offloaded.")
    pins = {k: cfg.offload_sections[k].get("pin_memory") for k in ("offload_optimizer", "offload_param")
            if getattr(cfg, k) in ("cpu", "nvme")}
    if len(set(pins.values())) > 1:
        add("warning", "offload_optimizer and offload_param disagree on pin_memory "
                       f"({pins['offload_optimizer']} vs {pins['offload_param']}).")
    threshold = _number(cfg.zero.get("stage3_param_persistence_threshold"), float)
    if cfg.stage == 3 and isinstance(threshold, float) and threshold > 10**8:
        add("warning", "stage3_param_persistence_threshold is very large: most parameters stay gathered, which "
                       "defeats ZeRO-3's memory savings.")
    scheduler = cfg.raw.get("scheduler") if isinstance(cfg.raw.get("scheduler"), dict) else {}
    optimizer = cfg.raw.get("optimizer")
    kind = str(optimizer.get("type", "")).lower() if isinstance(optimizer, dict) else None
    if scheduler.get("type") in ONE_PEAK_SCHEDULERS and kind in (None, "muon"):
        sched_params = scheduler.get("params") if isinstance(scheduler.get("params"), dict) else {}
        if "warmup_max_lr" in sched_params:
            peak = sched_params["warmup_max_lr"]
            what = f"one warmup_max_lr ({peak!r}; \"auto\" is the HF Trainer's or accelerate's learning rate)"
        else:  # the scheduler's own default
            old_warmup = deepspeed is not None and _versions.in_range(deepspeed, "<0.17.2")
            peak = 0.001 if scheduler["type"] == "WarmupDecayLR" or old_warmup else None
            what = f"no warmup_max_lr, so DeepSpeed's default {peak}"
        if peak is not None and _number(peak, float) is not None:  # "auto" or one number (not a list)
            whose = "Muon's two groups" if kind == "muon" else \
                "the caller's or the Trainer's optimizer (no optimizer section)"
            add("warning", f"scheduler {scheduler['type']} with {what}, over {whose}: DeepSpeed warms every param "
                           "group up to that one rate, so groups built with their own rates (LoRA+, LLaMA-Factory's "
                           "loraplus_lr_ratio, ms-swift's vit_lr and aligner_lr, axolotl's embedding_lr, Muon's "
                           "muon_lr and adam_lr) train at it, silently; the HF Trainer's own scheduler keeps each "
                           "group's rate. Drop the scheduler section, use WarmupCosineLR (it scales each group's own "
                           "rate), or write warmup_max_lr as a list, one rate per group.")
    bf16 = cfg.raw.get("bf16") if isinstance(cfg.raw.get("bf16"), dict) else cfg.raw.get("bfloat16")
    if deepspeed and _enabled(bf16) and cfg.stage in (0, 1) and _fp32_accumulation(cfg) \
            and _versions.in_range(deepspeed, BF16_OPTIMIZER_UNREACHABLE):
        add("warning", f"bf16 with grad_accum_dtype fp32 at ZeRO stage {cfg.stage}: DeepSpeed {deepspeed} builds its "
                       "fp16 wrapper (FP16_UnfusedOptimizer) here, not the BF16_Optimizer this config asks for (its "
                       "BFLOAT16 and DDP_BFLOAT16 are the same string, fixed in 0.18.5), so gradients accumulate in "
                       "bf16, not fp32" + (", and ZeRO-1 partitions no optimizer state: every rank holds all of it"
                                           if cfg.stage == 1 else "")
                       + ". zeroshim patch bf16_zero0_grads corrects that wrapper's loss scale (0.18.3-0.18.4 divide "
                       "every gradient by 65536), not this. Remedy: DeepSpeed >= 0.18.5.")
    if deepspeed and cfg.stage in (1, 2) and _enabled(bf16) and "check_grad_overflow" not in bf16 \
            and not _bf16_optimizer(cfg):
        if _versions.in_range(deepspeed, f">={BF16_OVERFLOW_CHECK_FROM}"):
            from . import _core

            silent = _core.get_patch("silent_overflow_skip")  # its range says where DeepSpeed skips in silence
            silent_here = _versions.in_range(deepspeed, silent.affects["deepspeed"])
            add("warning", f"bf16 (on, or \"auto\" where the trainer turns it on) with ZeRO stage {cfg.stage} and "
                           f"no bf16.check_grad_overflow: DeepSpeed {deepspeed} "
                           "skips every optimizer step whose gradients hold inf or NaN (its default from "
                           f"{BF16_OVERFLOW_CHECK_FROM}; before, the step was taken and the weights became NaN), "
                           + ("without a word (%s does not log \"OVERFLOW! Skipping step\"; zeroshim patch "
                              "silent_overflow_skip says it here)" % silent.versions if silent_here else
                              "logging \"OVERFLOW! Skipping step\"")
                           + ". A loss that overflows on every step then "
                           "trains nothing while the run goes on (the engine's skipped_steps counts them). Write "
                           "\"check_grad_overflow\": true to keep this and silence the note, or false for the "
                           f"behaviour before {BF16_OVERFLOW_CHECK_FROM}.")
        else:
            add("warning", f"bf16 (on, or \"auto\" where the trainer turns it on) with ZeRO stage {cfg.stage} and "
                           f"no bf16.check_grad_overflow: DeepSpeed {deepspeed} does not check bf16 gradients for inf "
                           f"or NaN here (the check is its default from {BF16_OVERFLOW_CHECK_FROM}), so a step whose "
                           "gradients hold them is applied: the weights become NaN for the rest of the run, and the "
                           "step's gradient norm is reported as a finite number (or nan). zeroshim patch "
                           "nonfinite_grad_step reports it as inf and says so; without the check it applies the step, "
                           "as DeepSpeed 0.19.8 does. "
                           + ("Write \"check_grad_overflow\": true to skip such steps."
                              if _versions.in_range(deepspeed, f">={BF16_OVERFLOW_SETTING_FROM}") else
                              f"The setting exists from DeepSpeed {BF16_OVERFLOW_SETTING_FROM}: there "
                              "\"check_grad_overflow\": true skips such steps."))
    return findings
