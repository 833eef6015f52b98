"""Capture's clean-ups of forms newer transformers releases trace, on small exported functions
(independent of the installed release): a tensor_split that keeps the whole tensor, a state
cloned, updated and copied back, and a counter tensor written in place but never read
(transformers 5.25's cache token counter)."""

import types

import pytest
import torch
from torch.export import Dim, export

from ssmshard.passes.canonicalize import clones_copied_back, whole_tensor_splits
from ssmshard.program import _drop_unread_constants

aten = torch.ops.aten


class _Split(torch.nn.Module):
    def __init__(self, keep_last: int):
        super().__init__()
        self.keep_last = keep_last

    def forward(self, x):
        whole, last = torch.tensor_split(x, [x.shape[1] - self.keep_last], dim=1)
        return whole * 2 if self.keep_last == 0 else torch.cat([whole * 2, last], dim=1)


def _exported(module, *args, dynamic=True):
    shapes = ({1: Dim("seq", min=2)},) if dynamic else None
    return export(module, args, dynamic_shapes=shapes).module()


def _targets(graph):
    return {node.target for node in graph.nodes if node.op == "call_function"}


def test_a_split_keeping_the_whole_tensor_becomes_the_tensor(fresh_seed):
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(fresh_seed))
    gm = _exported(_Split(keep_last=0), x)
    assert aten.tensor_split.indices in _targets(gm.graph)
    whole_tensor_splits(types.SimpleNamespace(graph=gm.graph), None)
    gm.recompile()
    assert aten.tensor_split.indices not in _targets(gm.graph)
    for length in (2, 7):
        y = torch.randn(2, length, 3)
        assert torch.equal(gm(y), y * 2)


def test_a_split_whose_second_piece_is_read_stays():
    gm = _exported(_Split(keep_last=1), torch.randn(2, 5, 3), dynamic=False)
    whole_tensor_splits(types.SimpleNamespace(graph=gm.graph), None)
    assert aten.tensor_split.indices in _targets(gm.graph)


class _Counting(torch.nn.Module):
    """Counts its calls in a plain tensor attribute (captured as a constant), as HF's cache layers
    count tokens from transformers 5.25; ``read`` returns the count too."""

    def __init__(self, read: bool):
        super().__init__()
        self.count = torch.tensor(0)
        self.read = read

    def forward(self, x):
        self.count.add_(x.shape[0])
        return (x + 1, self.count + 0) if self.read else x + 1


@pytest.mark.parametrize("read", [False, True])
def test_writes_to_a_constant_nothing_reads_are_dropped(read):
    exported = export(_Counting(read), (torch.randn(3, 2),))
    gm = exported.graph_module
    constants = [node for node, spec in zip(gm.graph.find_nodes(op="placeholder"), exported.graph_signature.input_specs)
                 if spec.kind.name == "CONSTANT_TENSOR"]
    assert constants and aten.add_.Tensor in _targets(gm.graph)
    _drop_unread_constants(gm.graph, constants)
    assert (aten.add_.Tensor in _targets(gm.graph)) == read


class _CopiedBack(torch.nn.Module):
    """A decode step's state update as transformers 5.25 traces it; ``read_between`` reads the
    state while its clone is updated (then the copy must stay)."""

    def __init__(self, read_between: bool):
        super().__init__()
        self.read_between = read_between

    def forward(self, state, x):
        state = state.clone()
        updated = state.clone()
        updated.mul_(x)
        old = state * 1 if self.read_between else None
        state.copy_(updated)
        return (state, old) if self.read_between else state


@pytest.mark.parametrize("read_between", [False, True])
def test_a_clone_copied_back_becomes_an_update_of_the_state(read_between, fresh_seed):
    generator = torch.Generator().manual_seed(fresh_seed)
    state, x = torch.randn(2, 3, generator=generator), torch.randn(2, 3, generator=generator)
    gm = _exported(_CopiedBack(read_between), state, x, dynamic=False)
    expected = gm(state, x)

    def count(target):
        return sum(node.target is target for node in gm.graph.nodes)
    assert (count(aten.clone.default), count(aten.copy_.default)) == (2, 1)
    clones_copied_back(types.SimpleNamespace(graph=gm.graph), None)
    gm.recompile()
    assert (count(aten.clone.default), count(aten.copy_.default)) == ((2, 1) if read_between else (1, 0))
    got = gm(state, x)
    for a, b in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, expected))):
        assert torch.equal(a, b)
