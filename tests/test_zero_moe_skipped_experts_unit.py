"""Unit tests of zero_moe_skipped_experts' reading of a block's source (patches/zero_moe_skipped_experts): each form
of the skip is removed, and nothing else is touched."""

import functools

import pytest

torch = pytest.importorskip("torch")

from zeroshim.patches.zero_moe_skipped_experts import rewrite  # noqa: E402


class Block(torch.nn.Module):
    SCALE = 2.0

    def __init__(self, n=4):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(n))
        self.calls = []
        self.__scale = 0.5

    def expert_hit(self, x, route):
        out = torch.zeros_like(x)
        expert_mask = torch.nn.functional.one_hot(route, num_classes=len(self.experts)).permute(1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=-1), 0).nonzero()
        for expert_idx in expert_hit:
            self.calls.append(int(expert_idx))
            rows = torch.where(expert_mask[expert_idx].squeeze(0))[0]
            out.index_add_(0, rows, self.experts[expert_idx](x[rows]))
        return out

    def continue_if_empty(self, x, route):
        out = torch.zeros_like(x)
        for i in range(len(self.experts)):
            rows = (route == i).nonzero().flatten()
            if rows.shape[0] == 0:
                continue
            self.calls.append(i)
            out.index_add_(0, rows, self.experts[i](x[rows]))
        return out

    def if_not_empty(self, x, route):
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (route == i).nonzero().flatten()
            if rows.numel() > 0:
                self.calls.append(i)
                out.index_add_(0, rows, expert(x[rows]))
        return out

    def with_else(self, x, route):  # the expert runs only where it got tokens, with an `else`: not removed
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (route == i).nonzero().flatten()
            if rows.numel() > 0:
                out.index_add_(0, rows, expert(x[rows]))
            else:
                self.calls.append(-i)
        return out

    def not_experts(self, x, route):  # a loop that does not touch self.experts: left alone
        for i in range(3):
            if x.shape[0] == 0:
                continue
        return x

    def not_numel(self, x, route):  # `if not <size>: continue`
        out = torch.zeros_like(x)
        for i in range(len(self.experts)):
            rows = (route == i).nonzero().flatten()
            if not rows.numel():
                continue
            self.calls.append(i)
            out.index_add_(0, rows, self.experts[i](x[rows]))
        return out

    def torch_nonzero(self, x, route):  # `torch.nonzero(<mask>)`, as_tuple=False
        out = torch.zeros_like(x)
        expert_mask = torch.nn.functional.one_hot(route, num_classes=len(self.experts)).permute(1, 0)
        hit = torch.nonzero(expert_mask.sum(dim=-1) > 0, as_tuple=False)
        for expert_idx in hit:
            self.calls.append(int(expert_idx))
            rows = torch.where(expert_mask[expert_idx].squeeze(0))[0]
            out.index_add_(0, rows, self.experts[expert_idx](x[rows]))
        return out

    def count_name(self, x, route):  # DeepSeek-V2's form: a count from enumerate(tokens per expert)
        order = route.argsort()
        outputs, start = [], 0
        for i, num_tokens in enumerate(torch.bincount(route, minlength=len(self.experts))):
            if num_tokens == 0:
                continue
            self.calls.append(i)
            outputs.append(self.experts[i](x[order][start:start + num_tokens]))
            start += num_tokens
        out = torch.empty_like(x)
        out[order] = torch.cat(outputs)
        return out

    def mangled(self, x, route, k=SCALE):  # a private name and a class-level default, compiled where they stand
        out = torch.zeros_like(x)
        for i in range(len(self.experts)):
            rows = (route == i).nonzero().flatten()
            if rows.shape[0] == 0:
                continue
            self.calls.append(i)
            out.index_add_(0, rows, self.experts[i](x[rows]) * self.__scale * k)
        return out

    # not a skip of an empty expert: never rewritten
    def skip_by_index(self, x, route):  # the loop index is not a count: refused, not rewritten
        out = self.experts[0](x)
        for i in range(len(self.experts)):
            if i == 0:
                continue
            out = out + self.experts[i](x)
        return out

    def if_by_index(self, x, route):
        out = self.experts[0](x)
        for i, expert in enumerate(self.experts):
            if i > 0:
                out = out + expert(x)
        return out

    def per_token(self, x, route):  # a loop over a nonzero() that is not the experts hit
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            rows = (route == e).nonzero()
            for r in rows:
                out[r] = out[r] + self.experts[e](x[r])
        return out

    def chunked(self, x, route):  # a loop around the loop over experts keeps its own test
        out = torch.zeros_like(x)
        for chunk in (torch.arange(3), torch.arange(3, 5)):
            if chunk.numel() > 0:
                for i, expert in enumerate(self.experts):
                    rows = chunk[route[chunk] == i]
                    out.index_add_(0, rows, expert(x[rows]))
        return out

    def attribute_size(self, x, route):  # a size of a module attribute is not an expert's token count
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            if self.experts[i].weight.numel() > 0:
                out = out + expert(x)
        return out

    helper = lambda self, x: x  # noqa: E731 - not one definition, and no experts: not read

    def counts_tolist(self, x, route):  # counts from .tolist(), every expert's, the skip removed: every expert
        out = torch.zeros_like(x)
        for i, n in enumerate(torch.bincount(route, minlength=len(self.experts)).tolist()):
            if n == 0:
                continue
            self.calls.append(i)
            rows = (route == i).nonzero().flatten()
            out.index_add_(0, rows, self.experts[i](x[rows]))
        return out

    # a skip in a form not removed: refused whole (no partial rewrite)
    def hit_used_twice(self, x, route):  # the selection read elsewhere too: rewriting it would change that
        out = torch.zeros_like(x)
        expert_mask = torch.nn.functional.one_hot(route, num_classes=len(self.experts)).permute(1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=-1), 0).nonzero()
        self.hit = len(expert_hit)
        for expert_idx in expert_hit:
            rows = torch.where(expert_mask[expert_idx].squeeze(0))[0]
            out.index_add_(0, rows, self.experts[expert_idx](x[rows]))
        return out

    def nested(self, x, route):
        out = torch.zeros_like(x)
        expert_mask = torch.nn.functional.one_hot(route, num_classes=len(self.experts)).permute(1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=-1), 0).nonzero()
        for expert_idx in expert_hit:
            rows = torch.where(expert_mask[expert_idx].squeeze(0))[0]
            if self.training:
                if rows.shape[0] == 0:
                    continue
            out.index_add_(0, rows, self.experts[expert_idx](x[rows]))
        return out

    def tolist(self, x, route):
        out = torch.zeros_like(x)
        expert_mask = torch.nn.functional.one_hot(route, num_classes=len(self.experts)).permute(1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=-1), 0).nonzero()
        for expert_idx in expert_hit.squeeze(-1).tolist():
            rows = torch.where(expert_mask[expert_idx])[0]
            out.index_add_(0, rows, self.experts[expert_idx](x[rows]))
        return out

    @functools.lru_cache(maxsize=None)  # noqa: B019 - a decorated method with a skip
    def decorated(self, x, route):
        for i in range(len(self.experts)):
            rows = (route == i).nonzero().flatten()
            if rows.numel() == 0:
                continue
            self.experts[i](x[rows])


FORMS = {"expert_hit": "expert_hit", "continue_if_empty": "continue_if_empty", "if_not_empty": "if_not_empty",
         "not_numel": "continue_if_empty", "torch_nonzero": "expert_hit", "count_name": "continue_if_empty",
         "mangled": "continue_if_empty", "counts_tolist": "continue_if_empty"}


@pytest.mark.parametrize("method", sorted(FORMS))
def test_each_form_runs_every_expert_with_the_same_output(method):
    torch.manual_seed(0)
    block = Block()
    x, route = torch.randn(5, 2), torch.tensor([1, 1, 3, 1, 3])
    expected = getattr(block, method)(x, route)
    assert block.calls == [1, 3]
    new, forms = rewrite(getattr(Block, method), "Block")
    assert forms == [FORMS[method]]
    block.calls.clear()
    got = new(block, x, route)
    assert block.calls == [0, 1, 2, 3]  # every expert, in index order
    assert torch.equal(got, expected)  # bit for bit: an empty slice adds nothing
    assert new.__defaults__ == getattr(Block, method).__defaults__
    got.sum().backward()
    assert all(p.grad is not None for p in block.experts.parameters())  # a gradient for every expert
    assert all(not p.grad.any() for p in (*block.experts[0].parameters(), *block.experts[2].parameters()))


def test_the_copy_keeps_the_methods_file_and_line_numbers():
    new, _ = rewrite(Block.continue_if_empty)
    assert new.__code__.co_filename == Block.continue_if_empty.__code__.co_filename
    assert new.__code__.co_firstlineno == Block.continue_if_empty.__code__.co_firstlineno
    assert new.__qualname__ == Block.continue_if_empty.__qualname__


@pytest.mark.parametrize("method", ["not_experts", "__init__", "if_by_index", "per_token", "chunked",
                                    "attribute_size", "helper"])
def test_no_skip_no_rewrite(method):
    assert rewrite(getattr(Block, method), "Block") == (None, [])


@pytest.mark.parametrize("method", ["skip_by_index", "nested", "tolist", "with_else", "hit_used_twice"])
def test_a_selection_in_another_form_is_refused_whole(method):
    """A loop over experts that keeps a `continue`, a test of a token count or a selection this patch does not
    rewrite: nothing of the method is used (a partial rewrite would say every expert runs where some do not)."""
    new, reason = rewrite(getattr(Block, method), "Block")
    assert new is None and isinstance(reason, str) and reason


def test_a_decorated_method_with_a_skip_is_named_not_rewritten():
    new, reason = rewrite(Block.decorated)
    assert new is None and reason == "it is decorated"


def test_a_method_whose_source_cannot_be_read_is_named():
    namespace = {}
    exec("def forward(self, x):\n    for e in self.experts:\n        pass\n", namespace)  # noqa: S102
    new, reason = rewrite(namespace["forward"])
    assert new is None and reason.startswith("its source cannot be read")


BLOCKS_MODULE = '''
import torch


class Skipping(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(2, 4, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))
        self.calls = []

    def forward(self, x):
        route = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i in range(len(self.experts)):
            rows = (route == i).nonzero().flatten()
            if rows.numel() == 0:
                continue
            self.calls.append(i)
            out.index_add_(0, rows, self.experts[i](x[rows]))
        return out


class Unreadable(Skipping):
    pass


class Child(Skipping):  # reaches the skip through super(): the base's method is the one rewritten
    def forward(self, x):
        return super().forward(x) * 1.0


_namespace = {}
exec("def forward(self, x):\\n    for e in self.experts:\\n        pass\\n    return x\\n", globals(), _namespace)
Unreadable.forward = _namespace["forward"]
'''

MARK = '''
import logging, sys, torch, zeroshim, deepspeed.runtime.engine
from zeroshim.patches import zero_moe_skipped_experts as patch
import blocks
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
original = vars(blocks.Skipping)["forward"]
marked, other, unreadable, child = blocks.Skipping(), blocks.Skipping(), blocks.Unreadable(), blocks.Child()
for block in (marked, other, child):  # every token to expert 1
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[1] = 1.0
patch._mark(torch.nn.ModuleList([marked, unreadable, child]), [0])
x = torch.rand(3, 2)
marked(x), other(x), child(x)
print("CALLS", marked.calls, other.calls, sorted(map(id, patch._marked)) == sorted(map(id, (marked, child))))
print("CHILD", child.calls)
marked.calls.clear()
with torch.no_grad():
    marked(x)
print("NOGRAD", marked.calls)
print("WRAPPED", vars(blocks.Skipping)["forward"] is not original,
      zeroshim.is_object_patched(blocks.Skipping, "forward"))
zeroshim.unpatch("zero_moe_skipped_experts")
marked.calls.clear()
marked(x)
print("RESTORED", vars(blocks.Skipping)["forward"] is original, marked.calls)
'''


def test_only_marked_modules_run_every_expert_and_undo_restores_the_class(tmp_path):
    """The rewritten method runs for the modules of the engine only (another instance keeps its skip), where
    grad is enabled; a
    per-expert block whose method cannot be read is named at WARNING; ``zeroshim.unpatch`` restores the class.
    Without DeepSpeed ranks: ``_mark`` is what the engine wrapper calls for a ZeRO-1/2 engine on several ranks."""
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    from harness import clean_env

    (tmp_path / "blocks.py").write_text(BLOCKS_MODULE)
    env = clean_env(PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", MARK], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.stdout.splitlines() if " " in line}
    assert said["CALLS"] == "[0, 1, 2, 3] [1] True"  # the marked module: every expert; the other keeps its skip
    assert said["CHILD"] == "[0, 1, 2, 3]"  # through super()
    assert said["NOGRAD"] == "[1]"  # no gradient to reduce (evaluation, generation): the skip stays
    assert said["WRAPPED"] == "True True"
    assert said["RESTORED"] == "True [1]"
    assert "could not make MoE block Unreadable run every expert" in out.stdout + out.stderr


def _exchange_on_threads(findings_of: dict, limit: float = 30.0) -> dict:
    """Every rank of ``findings_of`` (rank -> what it read; None: never posts) runs the exchange on one store, each
    in a thread: rank -> None (agreed) or the error's message."""
    import threading

    from torch.distributed import HashStore

    from zeroshim.patches import zero_moe_skipped_experts as patch

    store, ranks, out = HashStore(), sorted(findings_of), {}

    def run(rank):
        try:
            patch.exchange(store, findings_of[rank], ranks, rank, limit)
            out[rank] = None
        except Exception as exc:
            out[rank] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks if findings_of[r] is not None]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return out


def test_ranks_that_read_alike_go_on():
    read = {"m.Block": ["Block.forward"]}
    assert _exchange_on_threads({0: read, 1: dict(read), 2: dict(read)}) == {0: None, 1: None, 2: None}
    assert _exchange_on_threads({0: {}, 1: {}}) == {0: None, 1: None}  # no block anywhere: nothing to say


def test_ranks_that_read_differently_stop_naming_the_block_and_the_ranks():
    out = _exchange_on_threads({0: {"m.Block": ["Block.forward"]}, 1: {"m.Block": ["Block.forward: its source "
                                                                                   "cannot be read"]}, 2: {}})
    for rank in (0, 1, 2):
        assert out[rank].startswith("RanksDisagree: zeroshim[zero_moe_skipped_experts]: the ranks read the MoE "
                                    "blocks differently (Block: rank(s) 0 read"), out[rank]


def test_a_rank_that_never_says_stops_the_others_after_the_timeout_naming_it():
    out = _exchange_on_threads({0: {"m.Block": ["Block.forward"]}, 1: None}, limit=0.5)
    assert out == {0: out[0]} and "rank(s) 1 of this engine's data-parallel group did not say within 0.5 s" in out[0]


# -- experts containers: transformers 5's Switch/NLLB-MoE `...Experts(nn.ModuleDict)` run the expert_hit loop in
# their own forward (self is the experts); 4.x's Switch block loops over a `.tolist()` selection (refused, warned)
def _switch():
    pytest.importorskip("transformers")
    from transformers.models.switch_transformers import modeling_switch_transformers as module

    config = module.SwitchTransformersConfig(d_model=8, d_ff=8, num_experts=4, expert_capacity=64,
                                             router_jitter_noise=0.0, dropout_rate=0.0)
    return module, module.SwitchTransformersSparseMLP(config)


def test_a_container_of_experts_runs_every_expert_with_the_same_output():
    from zeroshim.patches.zero_moe_skipped_experts import _candidate, _container_class, _is_container

    module, block = _switch()
    container = getattr(module, "SwitchTransformersExperts", None)
    if container is None:
        pytest.skip("transformers 4.x: Switch's experts are a plain ModuleDict (the block loops)")
    assert _candidate(block) and _is_container(block.experts) and _container_class(container)
    new, forms = rewrite(container.forward, container.__name__, True)
    assert forms == ["expert_hit"]
    assert rewrite(container.forward, container.__name__) == (None, [])  # `self` is the experts only in a container
    torch.manual_seed(0)
    hidden = torch.randn(5, 8)
    selected = torch.zeros(5, 1, 4)
    selected[torch.arange(5), 0, torch.tensor([1, 1, 3, 1, 3])] = 1
    weights = torch.rand(5, 1)
    expected = block.experts(hidden, selected, weights)
    got = new(block.experts, hidden, selected, weights)
    assert torch.equal(got, expected)
    got.sum().backward()
    assert all(p.grad is not None for p in block.experts.parameters())  # experts 0 and 2 too (zero)
    assert not any(p.grad.any() for p in block.experts["expert_0"].parameters())


def test_the_4x_switch_block_is_refused_with_a_reason():
    from zeroshim.patches.zero_moe_skipped_experts import _candidate

    module, block = _switch()
    if hasattr(module, "SwitchTransformersExperts"):
        pytest.skip("transformers 5: the loop is in the experts container")
    assert _candidate(block)  # its experts: a plain ModuleDict (looked up with getattr)
    new, reason = rewrite(type(block).forward, type(block).__name__)
    assert new is None and "selection" in reason, reason
