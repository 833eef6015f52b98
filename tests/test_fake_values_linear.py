"""Shape propagation computes ``aten.linear``'s value by its shape rule (torch's CUDA kernel fails
on symbolic fake inputs); the rule must give what torch's own fake linear gives."""

import pytest
import torch

import ssmshard
from ssmshard.passes.fake_values import linear_value

from conftest import SIX_FAMILIES, small_model


def _same(a, b) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
            and a.requires_grad == b.requires_grad)


@pytest.mark.parametrize("family", SIX_FAMILIES)
@pytest.mark.parametrize("mode", ["forward", "decode"])
def test_linear_shape_rule_matches_torch_fake_linear(family, mode):
    program = ssmshard.capture(small_model(family), mode=mode)
    linears = [n for n in program.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears
    for node in linears:
        inputs = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args]
        fake_mode = inputs[0].fake_mode
        with fake_mode, torch.no_grad():
            assert _same(linear_value(*inputs), torch.ops.aten.linear.default(*inputs)), node.name
