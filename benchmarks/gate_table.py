"""Every patch's version gate, source fingerprint and DeepSpeed targets, checked
statically against a folder of extracted DeepSpeed sdists (issue #32 item 2).

    PYTHONPATH=. python benchmarks/gate_table.py SDISTS            # markdown: matrix + one line per verdict range
    PYTHONPATH=. python benchmarks/gate_table.py SDISTS --checks   # plus every check of every release
    PYTHONPATH=. python benchmarks/gate_table.py SDISTS --forced   # targets everywhere, as ZEROSHIM_<NAME>=on

``SDISTS`` holds extracted sdists, one folder per release named
``deepspeed-<version>/`` with the package under it (``deepspeed-0.12.0/deepspeed/
runtime/engine.py``).  ``pip download --no-binary :all: deepspeed==X`` builds the
sdist's metadata, which needs torch, and fails on the old releases; fetch the
``.tar.gz`` instead (its URL and sha256 are in ``https://pypi.org/pypi/deepspeed/
X/json``) and ``tar -xzf`` it into ``SDISTS``.  Nothing here imports DeepSpeed
(or torch): releases that cannot run on this machine are checked all the same.

Per patch and release:

* gate: the ``deepspeed`` specifier of ``affects``, compared as
  ``zeroshim._versions`` does (base version, prereleases included); the other
  packages of ``affects`` are shown as conditions (``+numpy>=2``), not decided;
* fingerprint: where ``fingerprint.module`` is a DeepSpeed module,
  ``zeroshim._source.check`` itself, run with ``sys.path`` set to the sdist's
  folder (so the file is found and matched exactly as ``import zeroshim``
  finds and matches it); where it decides against the version, as
  ``zeroshim._core.gate_verdict`` lets it, the verdict follows it and the cell
  is marked ``!``;
* targets: what the patch's ``patch_*`` functions require of DeepSpeed before
  they wrap anything (``require_attr``/``require_params``/``require`` and the
  ``NotAffected`` checks), read from the sdist's source with ``ast``.  These
  are listed by hand in ``REQUIREMENTS`` below (module-level names bound
  inside ``if``/``try`` blocks are not seen: they read as missing, a ``T`` to
  confirm by hand) (read from
  ``patches/<name>/__init__.py``); the script refuses to run when a patch with a DeepSpeed
  target, or one of its DeepSpeed target modules, has no entry there (a patch without one needs none).
  ``tests/test_gate_table_requirements.py`` runs every patch's ``patch_*`` functions on the installed
  DeepSpeed with a recording patcher, in every test environment, and fails where a name they require is
  not in its entry.  Targets outside
  DeepSpeed (torch, numpy, transformers, peft) do not vary with the release and
  are not checked.

Cell codes: ``A`` applies (gate says affected, every DeepSpeed requirement
present), ``T`` would be skipped with "target changed", ``N`` skipped as not
affected by an apply-time check, ``-`` not affected (gate), ``*`` the gate does
not look at DeepSpeed.  ``!`` marks a fingerprint that disagrees with the
version range.  With ``--forced``, ``a``/``t``/``n`` are what ``ZEROSHIM_<NAME>=on``
would meet where the gate says not affected.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys

os.environ["ZEROSHIM_DISABLED"] = "1"  # load the declarations; hook nothing
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zeroshim import _source, _versions  # noqa: E402
from zeroshim._core import load_patches  # noqa: E402
from zeroshim.patches import PATCH_MODULES  # noqa: E402  (load_patches makes it importable)

E = "deepspeed.runtime.engine"
S3 = "deepspeed.runtime.zero.stage3"
S12 = "deepspeed.runtime.zero.stage_1_and_2"
OFF = "deepspeed.runtime.zero.parameter_offload"
PPC = "deepspeed.runtime.zero.partitioned_param_coordinator"
#: zeroshim/_engines.py use(): what every patch tracking engines requires
ENGINE_TRACKING = [("attr", E, "DeepSpeedEngine.zero_optimization_stage"), ("attr", E, "DeepSpeedEngine.forward")]

#: patch -> its apply-time requirements on DeepSpeed, in the order its patch_* functions check them:
#:   ("attr", module, "Name" | "Class.attr" | "Class.a|b")   missing -> target changed ("a|b": either)
#:   ("params", module, "func" | "Class.meth", names)        a parameter missing -> target changed
#:   ("module", module)                                      no such source file -> target changed
#:   ("source", module, regex, what)                         regex not in the file -> target changed
#:   ("not_affected_if_in", module, "Class.meth", text)      text in that function's source -> not affected
#:   ("mark", module, regex, what)                           shown only: where the bug's line is (no fingerprint)
REQUIREMENTS = {
    "torch_elastic_compat": [
        ("mark", "deepspeed.elasticity.elastic_agent",
         r"from torch\.distributed\.elastic\.agent\.server\.api import [^\n(]*\blog\b", "imports `log`"),
        ("mark", "deepspeed.elasticity.elastic_agent",
         r"from torch\.distributed\.elastic\.agent\.server\.api import [^\n(]*\b_get_socket_with_port\b",
         "imports `_get_socket_with_port`"),
    ],
    "numpy2_compat": [("mark", "deepspeed.autotuning.scheduler", r"(?m)^from numpy import BUFSIZE",
                       "`from numpy import BUFSIZE`")],
    "nonreentrant_checkpoint": [("attr", E, "DeepSpeedEngine"), *ENGINE_TRACKING],
    "zero3_frozen_recompute": [
        ("attr", OFF, "DeepSpeedZeRoOffload"),
        ("attr", PPC, "iter_params"), ("attr", PPC, "z3_leaf_module"),
        ("attr", PPC, "PartitionedParameterCoordinator"),
        ("attr", PPC, "PartitionedParameterCoordinator.__release_param"),
        ("attr", OFF, "DeepSpeedZeRoOffload.get_param_coordinator"),
        ("attr", OFF, "DeepSpeedZeRoOffload.pre_sub_module_backward_function"),
        ("attr", OFF, "DeepSpeedZeRoOffload.pre_sub_module_forward_function"),
        ("attr", OFF, "DeepSpeedZeRoOffload.post_sub_module_backward_function"),
        ("attr", S3, "DeepSpeedZeroOptimizer_Stage3.backward_epilogue|backward"),
    ],
    "offload_clip_device": [
        ("params", S3, "DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads", ("sub_group_id", "total_norm")),
        ("params", S12, "DeepSpeedZeroOptimizer.unscale_and_clip_grads", ("grad_groups_flat", "total_norm")),
    ],
    "zero3_dummy_loss": [
        ("attr", E, "DeepSpeedEngine.backward"), ("attr", E, "DeepSpeedEngine.zero_optimization_stage"),
        ("attr", S3, "DeepSpeedZeroOptimizer_Stage3.reduce_ready_partitions_and_remove_grads"),
        ("attr", S3, "DeepSpeedZeroOptimizer_Stage3.__init__"),
    ],
    "zero2_offload_accumulation": [("attr", S12, "DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu")],
    "zero3_delegating_wrapper": [("attr", OFF, "DeepSpeedZeRoOffload")],
    "zero3_lora_target_parameters": [],
    "checkpoint_weights_only": [
        ("attr", "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine.load"),
        ("not_affected_if_in", "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",
         "TorchCheckpointEngine.load", "weights_only"),
        ("attr", "deepspeed.utils.zero_to_fp32", "parse_model_states"),
        ("attr", "deepspeed.utils.zero_to_fp32", "parse_optim_states"),
    ],
    "zero3_generate_sync": [],
    "zero3_moe_leaf": [
        ("attr", E, "DeepSpeedEngine._configure_distributed_model"),
        ("module", "deepspeed.utils.z3_leaf_module"),
    ],
    "zero_moe_skipped_experts": [("attr", E, "DeepSpeedEngine._configure_distributed_model")],
    "offload_worker_fork": [("attr", E, "DeepSpeedEngine"), *ENGINE_TRACKING],
    "epoch_boundary": [
        ("attr", E, "DeepSpeedEngine.empty_partition_cache"), *ENGINE_TRACKING,
        ("attr", "deepspeed.runtime.dataloader", "DeepSpeedDataLoader.__iter__"),
    ],
    "zero3_hf_config_weakref": [],
    "scheduler_dropped_groups": [
        ("params", E, "DeepSpeedEngine._configure_optimizer", ("client_optimizer", "model_parameters")),
    ],
    "zero3_peft_save": [],
    "loss_without_grad": [("attr", E, "DeepSpeedEngine.backward"), ("params", E, "DeepSpeedEngine.backward", ("loss",))],
    "stale_build_lock": [],  # torch's build lock: no DeepSpeed target
    "warmup_lr_groups": [("params", "deepspeed.runtime.lr_schedules", "WarmupLR.__init__",
                          ("optimizer", "warmup_min_lr", "warmup_max_lr"))],
    "warmup_zero_steps": [("params", "deepspeed.runtime.lr_schedules", "WarmupLR.__init__", ("warmup_num_steps",)),
                          ("params", "deepspeed.runtime.lr_schedules", "WarmupCosineLR.__init__",
                           ("warmup_num_steps",))],
    "zero_no_sync": [
        ("attr", E, "DeepSpeedEngine.zero_optimization_partition_gradients"),
        ("attr", E, "DeepSpeedEngine.zero_optimization_stage"),
        ("attr", E, "DeepSpeedEngine.no_sync"),
    ],
    "zero_manual_accumulation": [
        ("attr", E, "DeepSpeedEngine.allreduce_gradients"),
        ("attr", E, "DeepSpeedEngine.is_gradient_accumulation_boundary"),
        ("attr", E, "DeepSpeedEngine.zero_optimization_stage"),
    ],
    "zero3_gloo_gather": [
        ("params", "deepspeed.runtime.zero.partition_parameters", "Init._allgather_params_coalesced",
         ("param_list", "hierarchy", "quantize")),
    ],
    "zero_config_float_sizes": [
        ("params", "deepspeed.runtime.config", "get_zero_config", ("param_dict",)),
        ("attr", "deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
        # require_attr(model, "model_fields"): a pydantic v2 model; its base comes from config_utils
        ("source", "deepspeed.runtime.config_utils", r"(?m)^from pydantic import [^\n]*\bBaseModel\b",
         "DeepSpeedZeroConfig.model_fields (pydantic v2 BaseModel)"),
    ],
    "zero_auto_hidden_size": [],
    "trainer_auto_hidden_size": [],  # transformers' HfTrainerDeepSpeedConfig: no DeepSpeed target
    "zero3_init_auto_batch": [("params", "deepspeed.runtime.zero.partition_parameters", "Init.__init__",
                               ("config_dict_or_path", "config"))],
    "zero_empty_params": [("params", "deepspeed.runtime.zero.stage_1_and_2",
                           "DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads", ("param", "i")),
                          ("attr", "deepspeed.runtime.zero.stage_1_and_2",
                           "DeepSpeedZeroOptimizer._link_all_hp_params"),
                          ("params", "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._has_inf_or_nan",
                           ("x",)),
                          ("attr", "deepspeed.utils.mixed_precision_linkage", "link_hp_params"),
                          ("params", "deepspeed.utils.mixed_precision_linkage", "_init_lp_to_hp_mapping",
                           ("lp_param_list", "partition_start", "partition_size", "dp_group"))],
    "silent_overflow_skip": [("attr", "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.step")],
    "bf16_norm_assert": [("attr", "deepspeed.runtime.bf16_optimizer", "BF16_Optimizer.step"),
                         ("attr", "deepspeed.runtime.bf16_optimizer", "BF16_Optimizer.__init__"),
                         ("attr", "deepspeed.runtime.bf16_optimizer", "BF16_Optimizer.clear_hp_grads"),
                         ("attr", "deepspeed.runtime.bf16_optimizer", "BF16_Optimizer.clear_lp_grads"),
                         ("attr", "deepspeed.runtime.bf16_optimizer", "get_global_norm_of_tensors")],
    "engine_getattr_recursion": [("attr", "deepspeed.runtime.engine", "DeepSpeedEngine.__getattr__")],
    # each function is wrapped where it reads or writes param.grad first (the fingerprint's two parts): any one will do
    "bf16_full_grad": [("attr", "deepspeed.utils.tensor_fragment",
                        "safe_get_full_grad|safe_set_full_grad|safe_update_full_grad_vectorized"),
                       ("attr", "deepspeed.runtime.bf16_optimizer", "BF16_Optimizer._link_all_hp_params"),
                       # destroy() is wrapped where it exists (0.16 and later)
                       ("attr", "deepspeed.runtime.bf16_optimizer", "BF16_Optimizer._link_all_hp_params|destroy")],
    "zero_cpu_unreduced_grads": [("params", "deepspeed.runtime.zero.stage_1_and_2", "split_half_float_double",
                                  ("tensors",))],
    "nonfinite_grad_step": [
        ("attr", "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.step"),
        ("attr", "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.scaled_global_norm"),
        ("attr", "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._update_scale"),
        ("attr", "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.get_grad_norm_direct"),
        ("attr", "deepspeed.runtime.zero.stage_1_and_2",
         "DeepSpeedZeroOptimizer.complete_grad_norm_calculation_for_cpu_offload"),
        ("attr", "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.state_dict"),
        ("attr", "deepspeed.runtime.zero.stage3",
         "DeepSpeedZeroOptimizer_Stage3._overflow_check_and_loss_scale_update"),
        ("attr", "deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._get_norm_groups"),
        ("attr", "deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.state_dict")],
    "accelerate_accumulation_boundary": [],  # accelerate's Accelerator and DeepSpeedEngineWrapper: no DeepSpeed target
    "zero3_mixed_dtype_gather": [
        ("params", "deepspeed.runtime.zero.partition_parameters", "Init._all_gather",
         ("param_list", "async_op", "hierarchy")),
    ],
    "zero3_conversion_dropped_keys": [],
    "zero3_inflight_params": [
        ("attr", PPC, "PartitionedParameterCoordinator"),
        ("attr", PPC, "iter_params"),
        # require_attr(cls, "_PartitionedParameterCoordinator__release_param"): the mangled name of this method
        ("attr", PPC, "PartitionedParameterCoordinator.__release_param"),
        ("attr", PPC, "PartitionedParameterCoordinator.reset_step"),
        ("attr", PPC, "PartitionedParameterCoordinator._invalidate_trace"),
        ("attr", PPC, "PartitionedParameterCoordinator.release_and_reset_all"),
    ],
    "trainer_max_grad_norm": [],  # transformers' HfTrainerDeepSpeedConfig: no DeepSpeed target
    "zero3_trace_rehook": [
        ("attr", "deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload"),
        ("attr", "deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload.get_param_coordinator"),
        # the one of _register_deepspeed_module / _register_hooks_recursively the release has
        ("source", "deepspeed.runtime.zero.parameter_offload",
         r"def _register_(deepspeed_module|hooks_recursively)\(self, module",
         "DeepSpeedZeRoOffload's hook registration"),
        ("attr", PPC, "PartitionedParameterCoordinator._clear_trace_structures"),
        ("attr", PPC, "PartitionedParameterCoordinator._invalidate_trace"),
        ("attr", PPC, "PartitionedParameterCoordinator.is_invalid_trace"),
        ("attr", PPC, "PartitionedParameterCoordinator.record_parameters"),
    ],
    "zero3_from_config_init": [],  # transformers' PreTrainedModel: no DeepSpeed target
    "zero3_unwrapped_model": [],  # transformers' PreTrainedModel: no DeepSpeed target
    "zero_optimizer_defaults": [("attr", "deepspeed.runtime.base_optimizer", "DeepSpeedOptimizer")],
    "zero3_init_arange": [("attr", "deepspeed.runtime.zero.partition_parameters",
                           "zero_wrapper_for_fp_tensor_constructor"),
                          ("attr", "deepspeed.runtime.zero.partition_parameters", "_orig_torch_arange")],
    "bf16_zero1_last_microbatch": [("attr", E, "DeepSpeedEngine._backward_epilogue"),
                                   ("attr", "deepspeed.runtime.bf16_optimizer", "BF16_Optimizer.backward_epilogue")],
    "zero3_inference_mode": [("params", PPC, "PartitionedParameterCoordinator.fetch_sub_module",
                              ("current_submodule", "forward")),
                             ("params", "deepspeed.runtime.zero.partition_parameters", "Init._all_gather",
                              ("param_list",))],
    "muon_group_lr": [("params", E, "DeepSpeedEngine._configure_basic_optimizer", ("model_parameters",)),
                      ("attr", E, "DeepSpeedEngine.optimizer_name"), ("attr", E, "DeepSpeedEngine.optimizer_params")],
    "muon_frozen_params": [("params", E, "DeepSpeedEngine._configure_basic_optimizer", ("model_parameters",)),
                           ("attr", E, "DeepSpeedEngine.optimizer_name"),
                           ("attr", E, "DeepSpeedEngine.optimizer_params"),
                           ("attr", E, "DeepSpeedEngine.zero_optimization_stage"),
                           ("attr", E, "DeepSpeedEngine.fp16_enabled"), ("attr", E, "DeepSpeedEngine.bfloat16_enabled")],
    "muon_zero_supported": [("params", "deepspeed.runtime.zero.utils", "is_zero_supported_optimizer", ("optimizer",)),
                            ("attr", "deepspeed.runtime.zero.muon.muon_optimizer", "MuonWithAuxAdam")],
    "bf16_zero0_grads": [("params", E, "DeepSpeedEngine._configure_fp16_optimizer", ("optimizer", "low_precision_dtype")),
                         ("attr", E, "DeepSpeedEngine._take_model_step"),
                         ("attr", E, "FP16_UnfusedOptimizer"),
                         ("attr", "deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer.load_state_dict")],
    "zero2_accumulation_overwrite": [("params", "deepspeed.runtime.zero.stage_1_and_2",
                                      "DeepSpeedZeroOptimizer.get_all_grad_tensors", ("tensor_list", "dtype")),
                                     ("attr", "deepspeed.runtime.zero.stage_1_and_2",
                                      "DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue")],
    "muon_newton_schulz": [("attr", E, "MuonWithAuxAdam"),
                           ("attr", "deepspeed.runtime.zero.muon.muon_optimizer", "MuonWithAuxAdam.__init__"),
                           ("params", E, "DeepSpeedEngine._configure_bf16_optimizer", ("optimizer",)),
                           ("params", "deepspeed.runtime.zero.muon.original_muon", "muon_update",
                            ("grad", "momentum", "beta"))],
    "gas_output_scaling": [("params", E, "DeepSpeedEngine.backward", ("loss", "retain_graph", "scale_wrt_gas")),
                           ("params", E, "DeepSpeedEngine._backward_prologue_per_tensor", ("grad",)),
                           ("attr", E, "DeepSpeedEngine.gradient_accumulation_steps")],
    "zero3_universal_load": [("params", "deepspeed.runtime.zero.stage3",
                              "DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3",
                              ("checkpoint_dir",)),
                             ("params", "deepspeed.runtime.zero.stage3",
                              "DeepSpeedZeroOptimizer_Stage3._load_global_state_stage3", ("sd",))],
}


# -- reading a release's source -----------------------------------------------------------------------------
class Release:
    def __init__(self, root: str, version: str):
        self.root, self.version, self._trees = root, version, {}

    def file(self, module: str):
        saved = sys.path[:]
        sys.path[:] = [self.root]
        try:
            return _source.module_file(module)
        finally:
            sys.path[:] = saved

    def text(self, module: str):
        path = self.file(module)
        if path is None:
            return None
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def tree(self, module: str):
        if module not in self._trees:
            text = self.text(module)
            self._trees[module] = None if text is None else ast.parse(text)
        return self._trees[module]

    def fingerprint(self, fingerprint):
        """``zeroshim._source.check`` with this release's folder as the whole ``sys.path``."""
        saved = sys.path[:]
        sys.path[:] = [self.root]
        try:
            return _source.check(fingerprint)
        finally:
            sys.path[:] = saved

    # names
    def _imported(self, module: str, node: ast.ImportFrom) -> str:
        """The absolute module name of ``from <node.module> import ...`` written in ``module``."""
        if not node.level:
            return node.module or ""
        package = module.split(".")
        if not self.file(module).endswith("__init__.py"):
            package = package[:-1]  # a plain module's package
        package = package[: len(package) - (node.level - 1)]
        return ".".join(package + ([node.module] if node.module else []))

    def top_level(self, module: str, name: str):
        """``(kind, node_or_origin)`` of a module-level name, following ``from x import name`` within deepspeed."""
        tree = self.tree(module)
        if tree is None:
            return None
        found = None
        for node in tree.body:  # the last binding wins, as at run time
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = ("def", node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = ("value", node)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = ("import", (self._imported(module, node), alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if (alias.asname or alias.name.split(".")[0]) == name:
                        found = ("value", node)
        if found and found[0] == "import":
            origin, original = found[1]
            if origin.startswith("deepspeed") and self.file(origin):
                return self.top_level(origin, original) or ("external", origin)
            return ("external", origin)
        return found

    def member(self, module: str, cls_name: str, attr: str, depth: int = 0):
        """The ``ast`` node defining ``cls.attr``: the class body, then its bases defined in deepspeed (as the
        MRO would, depth first); None if no deepspeed class on the way defines it (bases outside deepspeed,
        nn.Module or object, are not read: every attribute required here is DeepSpeed's own)."""
        found = self.top_level(module, cls_name)
        if not found or found[0] != "def" or not isinstance(found[1], ast.ClassDef) or depth > 10:
            return None
        cls = found[1]
        for node in cls.body:  # a __name is spelled as written in the source (not mangled)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
                return node
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                    return node
        home = self._home(module, cls_name)
        for base in cls.bases:
            if isinstance(base, ast.Name):
                result = self.member(self._home(home, base.id), base.id, attr, depth + 1)
                if result is not None:
                    return result
        return None

    def _home(self, module: str, name: str) -> str:
        """The module whose source defines ``name`` as seen from ``module``."""
        tree = self.tree(module)
        for node in tree.body if tree else ():
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        origin = self._imported(module, node)
                        if origin.startswith("deepspeed") and self.file(origin):
                            return self._home(origin, alias.name)
        return module

    def lookup(self, module: str, dotted: str):
        if "." not in dotted:
            found = self.top_level(module, dotted)
            return found[1] if found and found[0] == "def" else found
        cls_name, attr = dotted.split(".", 1)
        return self.member(self._home(module, cls_name), cls_name, attr)


def params_of(node) -> set:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]  # inspect.signature lists them too
    return set(names)


# -- one check ------------------------------------------------------------------------------------------------
def check(release: Release, requirement) -> "tuple[str, str]":
    """``(outcome, what was seen)``; outcome is "ok", "target", "not_affected", "mark+" or "mark-"."""
    kind, module = requirement[0], requirement[1]
    short = module.replace("deepspeed.", "", 1)
    if release.file(module) is None:
        if kind == "mark":
            return "mark-", f"no {short}"
        return "target", f"{short} does not exist"
    if kind == "module":
        return "ok", f"{short} exists"
    if kind in ("source", "mark"):
        regex, what = requirement[2], requirement[3]
        found = re.search(regex, release.text(module)) is not None
        if kind == "mark":
            return ("mark+" if found else "mark-"), f"{short} {what}: {'yes' if found else 'no'}"
        return ("ok" if found else "target"), f"{what} {'in' if found else 'not in'} {short}"
    dotted = requirement[2]
    if kind == "attr":
        head, _, tail = dotted.rpartition(".")
        for option in tail.split("|"):
            node = release.lookup(module, f"{head}.{option}" if head else option)
            if node is not None:
                return "ok", f"{short}.{head + '.' if head else ''}{option}"
        return "target", f"{short}.{dotted} does not exist"
    node = release.lookup(module, dotted)
    if node is None or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "target", f"{short}.{dotted} does not exist" if node is None else f"{short}.{dotted}: not a function"
    if kind == "params":
        missing = [n for n in requirement[3] if n not in params_of(node)]
        if missing:
            return "target", f"{short}.{dotted} has no parameter(s) {', '.join(missing)}"
        return "ok", f"{short}.{dotted}({', '.join(requirement[3])})"
    if kind == "not_affected_if_in":
        text = requirement[3]
        segment = ast.get_source_segment(release.text(module), node) or ""
        if text in segment:
            return "not_affected", f"{short}.{dotted} mentions {text}"
        return "ok", f"{short}.{dotted} does not mention {text}"
    raise ValueError(f"unknown requirement kind {kind!r}")


# -- one patch on one release -------------------------------------------------------------------------------
def verdict(patch, release: Release, forced: bool = False) -> dict:
    """The cell for ``patch`` on ``release``; ``forced``: as with ``ZEROSHIM_<NAME>=on`` (gate ignored)."""
    spec = patch.affects.get("deepspeed")
    others = [f"{k}{v or ' (any)'}" for k, v in patch.affects.items() if k != "deepspeed"]
    row = {"checks": [], "others": others, "fingerprint": None, "disagree": False,
           "marks": [check(release, r)[1] for r in REQUIREMENTS[patch.name] if r[0] == "mark"]}
    if spec is None:
        row.update(code="*", text="gate does not look at DeepSpeed")
        return row
    affected = bool(_versions.in_range(release.version, spec))
    reason = f"{release.version} {'in' if affected else 'outside'} {spec or '(every release)'}"
    fingerprint = patch.fingerprint
    if fingerprint is not None and fingerprint.module.split(".")[0] == "deepspeed":
        bug, seen = release.fingerprint(fingerprint)
        seen = seen.replace(release.root + os.sep, "")
        row["fingerprint"] = "n/a" if bug is None else ("bug" if bug else "no bug")
        reason += f"; fingerprint: {seen}"
        if bug is not None and bug != affected:
            row["disagree"] = True
            affected = bug  # zeroshim._core.gate_verdict: the source decides
    if not affected and not forced:
        row.update(code="-", text="not affected")
        return row
    outcome = None
    for requirement in REQUIREMENTS[patch.name]:
        if requirement[0] == "mark":
            continue
        result, seen = check(release, requirement)
        row["checks"].append((result, seen))
        if outcome is None and result in ("target", "not_affected"):
            outcome = (result, seen)
    if outcome is None:
        row.update(code="A", text="applies")
    elif outcome[0] == "target":
        row.update(code="T", text=f"skipped: target changed: {outcome[1]}")
    else:
        row.update(code="N", text=f"skipped: not affected: {outcome[1]}")
    if not affected:  # --forced outside the range: lower case
        row.update(code=row["code"].lower(), text=f"forced: {row['text']}")
    return row


def releases_in(folder: str):
    from packaging.version import Version

    found = []
    for name in os.listdir(folder):
        match = re.fullmatch(r"deepspeed-(\d[\w.]*)", name)
        if match and os.path.isfile(os.path.join(folder, name, "deepspeed", "__init__.py")):
            found.append(Release(os.path.join(folder, name), match.group(1)))
    return sorted(found, key=lambda r: Version(r.version))


def validate(patches) -> None:
    for name in PATCH_MODULES:
        if name not in REQUIREMENTS and not any(m.startswith("deepspeed") for m in patches[name].targets):
            REQUIREMENTS[name] = []  # no DeepSpeed target: nothing of the release to read
        if name not in REQUIREMENTS:
            sys.exit(f"gate_table.py: no REQUIREMENTS for patch {name}: read its patch_* functions and add them")
        declared = {r[1] for r in REQUIREMENTS[name] if r[0] != "mark"}
        for module in patches[name].targets:
            if module.startswith("deepspeed") and not any(d.startswith(module.rsplit(".", 1)[0]) for d in declared):
                sys.exit(f"gate_table.py: patch {name} targets {module}, which REQUIREMENTS does not cover")


def joined(versions, texts, sep=", ") -> str:
    return sep.join(f"{a}–{b} {t}" if a != b else f"{a} {t}" for a, b, t in spans(versions, texts))


def spans(versions, texts):
    """Consecutive releases with the same text: [(first, last, text)]."""
    out = []
    for version, text in zip(versions, texts):
        if out and out[-1][2] == text:
            out[-1][1] = version
        else:
            out.append([version, version, text])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sdists", help="folder of extracted sdists, deepspeed-<version>/")
    parser.add_argument("--checks", action="store_true", help="print every requirement check too")
    parser.add_argument("--forced", action="store_true",
                        help="check the targets everywhere, as with ZEROSHIM_<NAME>=on (the gate ignored)")
    opts = parser.parse_args()
    patches = load_patches()
    validate(patches)
    releases = releases_in(opts.sdists)
    if not releases:
        sys.exit(f"gate_table.py: no deepspeed-<version>/deepspeed/__init__.py under {opts.sdists}")
    versions = [r.version for r in releases]
    table = {name: [verdict(patches[name], r, opts.forced) for r in releases] for name in PATCH_MODULES}

    print("| patch | gate (`affects`) | " + " | ".join(versions) + " |")
    print("|---|---|" + "---|" * len(versions))
    for name in PATCH_MODULES:
        affects = ", ".join(f"{k} `{v}`" if v else f"{k} (any)" for k, v in patches[name].affects.items())
        cells = [row["code"] + ("!" if row["disagree"] else "") for row in table[name]]
        print(f"| {name} | {affects} | " + " | ".join(cells) + " |")
    print()
    for name in PATCH_MODULES:
        rows = table[name]
        fp = patches[name].fingerprint
        fp_note = ""
        if fp is not None and fp.module.startswith("deepspeed"):
            fp_note = "; fingerprint: " + joined(versions, [r["fingerprint"] for r in rows])
        elif fp is not None:
            fp_note = f"; fingerprint on {fp.module} (not DeepSpeed: not checked here)"
        marks = ""
        marked = [r["marks"] for r in rows]
        if any(marked):
            marks = "; bug's line: " + joined(versions, ["; ".join(m) for m in marked])
        verdicts = ", ".join(f"{a}–{b}: {t}" if a != b else f"{a}: {t}"
                             for a, b, t in spans(versions, [r["text"] for r in rows]))
        others = rows[0]["others"]
        print(f"- **{name}**: {verdicts}" + (f" (also needs {', '.join(others)})" if others else "") + fp_note + marks)
        if any(r["disagree"] for r in rows):
            print(f"  - fingerprint and version range DISAGREE on "
                  f"{', '.join(v for v, r in zip(versions, rows) if r['disagree'])}")
    if opts.checks:
        print()
        for name in PATCH_MODULES:
            for version, row in zip(versions, table[name]):
                for result, seen in row["checks"]:
                    print(f"{name} {version} {result}: {seen}")


if __name__ == "__main__":
    main()
