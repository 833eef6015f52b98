"""The sharding passes on small hand-made programs, rule category by rule category.

Each test exports a few-line module, gives its weights placements, runs ``propagate``,
``localize`` and ``communicate`` for one rank (no process group: the passes only rewrite the
graph) and asserts the placements recorded on the nodes, the collectives inserted and the
local sizes, not just final numbers.
"""

import pytest
import torch
import torch.nn.functional as F

import ssmshard  # noqa: F401  (registers torch.ops.ssmshard)
from ssmshard.passes import run_pipeline
from ssmshard.passes.shard import ReducePolicy, SequenceParallelPolicy, ShardingError, sharding_steps
from ssmshard.placement import PARTIAL, REPLICATE, Replicate, Segment, SeqShard, Shard, even
from ssmshard.program import Program, op_name

ssm = torch.ops.ssmshard
aten = torch.ops.aten


def program_of(module, *inputs):
    exported = torch.export.export(module, inputs, strict=False,
                                   dynamic_shapes=tuple({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
                                                        if x.dim() >= 2 else None for x in inputs))
    program = Program.from_exported(exported, mode="forward", family=None, model=module, state_specs=[],
                                    capture_device=torch.device("cpu"))
    return run_pipeline(program, ["tag"])


def shard(program, placements, *, rank=0, tp=2, policy=None, training=False):
    options = {"placements": placements, "rank": rank, "tp": tp, "group": "unit-test", "training": training,
               "policy": policy}
    return run_pipeline(program, sharding_steps(options))


def nodes(program, target):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target is target]


def collectives(program):
    return [op_name(n) for n in program.graph.nodes if n.op == "call_function"
            and op_name(n).split(".")[-1] in ("all_reduce", "all_gather", "all_gather_partial_grad",
                                              "reduce_scatter", "split", "tp_copy")]


class MLP(torch.nn.Module):
    """up (column-parallel) -> silu -> down (row-parallel, with bias) -> + residual."""

    def __init__(self, bias=True):
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.down_proj = torch.nn.Linear(16, 8, bias=bias)

    def forward(self, x):
        return x + self.down_proj(F.silu(self.up(x)))


MLP_PLACEMENTS = {"up.weight": Shard(0, (even(16, 2),)), "down_proj.weight": Shard(1, (even(16, 2),))}


# --------------------------------------------------------------------------- linear
def test_column_then_row_parallel_gives_one_all_reduce_with_the_bias_after_it():
    program = shard(program_of(MLP(), torch.randn(2, 5, 8)), MLP_PLACEMENTS)
    (up,) = [n for n in nodes(program, aten.linear.default) if n.args[1].name.endswith("up_weight")]
    assert up.meta["placement"] == Shard(2, (even(16, 2),))
    (down,) = [n for n in nodes(program, aten.linear.default) if "down" in n.args[1].name]
    assert down.meta["placement"] == PARTIAL and len(down.args) == 2  # the bias left the matmul
    (reduced,) = nodes(program, ssm.all_reduce.default)
    assert reduced.args[0] is down and reduced.meta["placement"] == REPLICATE
    bias_add = next(u for u in reduced.users if u.target is aten.add.Tensor)
    assert bias_add.args[1].name.endswith("down_proj_bias")
    assert [p.name for p in program.sync_points] == ["down_proj"]
    assert program.sync_points[0].bytes_per_token == 8 * 4
    weights = {n.name: tuple(n.meta["val"].shape) for n in program.graph.nodes if n.op == "placeholder"}
    assert weights["p_up_weight"] == (8, 8) and weights["p_down_proj_weight"] == (8, 8)


def test_training_copies_replicated_activations_into_sharded_ops():
    program = shard(program_of(MLP(bias=False), torch.randn(2, 5, 8)), MLP_PLACEMENTS, training=True)
    (copy,) = nodes(program, ssm.tp_copy.default)
    assert copy.args[0].op == "placeholder" and copy.meta["placement"] == Replicate(partial_grad=True)
    assert all(u.target is aten.linear.default for u in copy.users)


class TwoPartials(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.a = torch.nn.Linear(16, 8, bias=False)
        self.b = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = self.up(x)
        return torch.tanh(self.a(h) + self.b(h))


def test_an_add_of_partial_sums_stays_partial_and_is_reduced_once():
    rows = Shard(1, (even(16, 2),))
    placements = {"up.weight": Shard(0, (even(16, 2),)), "a.weight": rows, "b.weight": rows}
    program = shard(program_of(TwoPartials(), torch.randn(2, 3, 8)), placements)
    (add,) = nodes(program, aten.add.Tensor)
    assert add.meta["placement"] == PARTIAL
    (reduced,) = nodes(program, ssm.all_reduce.default)
    assert reduced.args[0] is add


def test_the_input_of_a_row_parallel_linear_must_be_split_alike():
    rows = Shard(1, (even(16, 2),))
    with pytest.raises(ShardingError, match=r"linear with input R and weight S\(1:16/2\)"):
        shard(program_of(TwoPartials(), torch.randn(2, 3, 8)), {"a.weight": rows})


# --------------------------------------------------------------------------- views and pointwise
class Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 16, bias=False)
        self.scale = torch.nn.Parameter(torch.randn(16))

    def forward(self, x):
        b, l, _ = x.shape
        q = (self.q(x) * self.scale).view(b, l, 4, 4).transpose(1, 2)
        return q.sum(-1)


def test_views_move_the_cut_and_take_local_sizes():
    placements = {"q.weight": Shard(0, (even(16, 2),)), "scale": Shard(0, (even(16, 2),))}
    program = shard(program_of(Heads(), torch.randn(2, 5, 8)), placements)
    (view,) = nodes(program, aten.view.default)
    assert view.meta["placement"] == Shard(2, (Segment(4, 2),))
    assert view.args[1][2] == 2  # 4 heads -> 2 per rank
    (transpose,) = nodes(program, aten.transpose.int)
    assert transpose.meta["placement"] == Shard(1, (Segment(4, 2),))
    (total,) = nodes(program, aten.sum.dim_IntList)
    assert total.meta["placement"] == Shard(1, (Segment(4, 2),))


def test_a_replicated_operand_must_broadcast_along_the_cut():
    placements = {"q.weight": Shard(0, (even(16, 2),))}  # scale stays whole: 16 != 8 local channels
    with pytest.raises(ShardingError, match="not broadcast along sharded dim 2"):
        shard(program_of(Heads(), torch.randn(2, 5, 8)), placements)


# --------------------------------------------------------------------------- reductions
class MeanOverFeatures(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False)

    def forward(self, x):
        return self.up(x).mean(-1)


def test_a_mean_over_the_cut_is_refused():
    with pytest.raises(ShardingError, match="reduces over the sharded dim"):
        shard(program_of(MeanOverFeatures(), torch.randn(2, 5, 8)), {"up.weight": Shard(0, (even(16, 2),))})


# --------------------------------------------------------------------------- attention
class Attention(torch.nn.Module):
    def __init__(self, kv_heads):
        super().__init__()
        self.q_proj = torch.nn.Linear(16, 16, bias=False)
        self.k_proj = torch.nn.Linear(16, 4 * kv_heads, bias=False)
        self.v_proj = torch.nn.Linear(16, 4 * kv_heads, bias=False)
        self.o_proj = torch.nn.Linear(16, 16, bias=False)
        self.kv_heads = kv_heads

    def forward(self, x):
        b, l, _ = x.shape
        q = self.q_proj(x).view(b, l, 4, 4).transpose(1, 2)
        k = self.k_proj(x).view(b, l, self.kv_heads, 4).transpose(1, 2)
        v = self.v_proj(x).view(b, l, self.kv_heads, 4).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != 4)
        return self.o_proj(out.transpose(1, 2).reshape(b, l, 16))


@pytest.mark.parametrize("kv_heads, kv_segment", [(2, Segment(8, 2)), (1, Segment(4, 1, 2))])
def test_attention_splits_heads_and_shares_key_value_heads(kv_heads, kv_segment):
    placements = {"q_proj.weight": Shard(0, (even(16, 2),)), "k_proj.weight": Shard(0, (kv_segment,)),
                  "v_proj.weight": Shard(0, (kv_segment,)), "o_proj.weight": Shard(1, (even(16, 2),))}
    for rank in (0, 1):
        program = shard(program_of(Attention(kv_heads), torch.randn(2, 5, 16)), placements, rank=rank)
        (sdpa,) = nodes(program, aten.scaled_dot_product_attention.default)
        assert sdpa.meta["placement"] == Shard(1, (Segment(4, 2),))
        assert [p.name for p in program.sync_points] == ["o_proj"]


# --------------------------------------------------------------------------- factories
class StateBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False)

    def forward(self, x):
        state = torch.zeros(x.shape[0], 16)
        state.copy_(self.up(x)[:, -1])
        return state * 2


def test_a_buffer_receiving_a_sharded_value_is_allocated_locally():
    program = shard(program_of(StateBuffer(), torch.randn(2, 5, 8)), {"up.weight": Shard(0, (even(16, 2),))})
    (zeros,) = nodes(program, aten.zeros.default)
    assert zeros.meta["placement"] == Shard(1, (even(16, 2),)) and zeros.args[0][1] == 8


# --------------------------------------------------------------------------- SSM ops
class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = torch.nn.Linear(8, 16, bias=False)
        self.conv_weight = torch.nn.Parameter(torch.randn(16, 4))
        self.out_proj = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = ssm.causal_conv1d(self.in_proj(x).transpose(1, 2), self.conv_weight, None, "silu")
        return self.out_proj(h.transpose(1, 2))


def test_a_causal_conv_runs_on_this_ranks_channels():
    channels = (even(16, 2),)
    placements = {"in_proj.weight": Shard(0, channels), "conv_weight": Shard(0, channels),
                  "out_proj.weight": Shard(1, channels)}
    program = shard(program_of(Conv(), torch.randn(2, 5, 8)), placements)
    (conv,) = nodes(program, ssm.causal_conv1d.default)
    assert conv.meta["placement"] == Shard(1, channels)
    assert [p.kind for p in program.sync_points] == ["all_reduce"]
    with pytest.raises(ShardingError, match="conv_weight is R, expected S\\(0:16/2\\)"):
        shard(program_of(Conv(), torch.randn(2, 5, 8)), {**placements, "conv_weight": REPLICATE})


# --------------------------------------------------------------------------- policies
class Block(torch.nn.Module):
    """An RMS-normed residual block: the residual stream is everything outside up/down."""

    def __init__(self):
        super().__init__()
        self.norm_weight = torch.nn.Parameter(torch.ones(8))
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.down_proj = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        return x + self.down_proj(F.silu(self.up(h)))


def test_sequence_parallel_cuts_the_residual_stream_and_gathers_it_for_the_block():
    program = program_of(Block(), torch.randn(2, 6, 8))
    program = shard(program, {k: v for k, v in MLP_PLACEMENTS.items()}, policy=SequenceParallelPolicy(),
                    training=True)
    kinds = collectives(program)
    assert kinds.count("ssmshard.split") == 1  # the replicated input, cut locally
    assert kinds.count("ssmshard.all_gather_partial_grad") == 1  # into the column-parallel up
    assert kinds.count("ssmshard.reduce_scatter") == 1  # down's partial sums into the stream
    assert kinds.count("ssmshard.all_gather") == 1  # the output back to every token
    (residual,) = [n for n in nodes(program, aten.add.Tensor) if isinstance(n.meta["placement"], SeqShard)
                   and n.args[0].target is ssm.split.default]
    assert residual.meta["val"].shape[1] != program.graph.find_nodes(op="placeholder")[-1].meta["val"].shape[1]
    # The norm's weight reads this rank's tokens only: its gradient is summed over ranks.
    assert any(n.args[0].name.endswith("norm_weight") for n in nodes(program, ssm.tp_copy.default))


class ReduceScatterThenGather(ReducePolicy):
    """Every partial sum reduced as reduce_scatter along the last dim followed by all_gather."""

    def lower(self, comm, value, have, want, consumer):
        if have == PARTIAL and isinstance(want, Replicate):
            scattered = comm.reduce_scatter(value, value.meta["val"].dim() - 1)
            last = value.meta["val"].dim() - 1
            return comm.gather(scattered, last, consumer, partial_grad=want.partial_grad,
                               length=value.meta["val"].shape[last])
        return comm.standard(value, have, want, consumer)


def test_a_policy_chooses_the_collectives():
    program = shard(program_of(MLP(bias=False), torch.randn(2, 5, 8)), MLP_PLACEMENTS,
                    policy=ReduceScatterThenGather())
    assert collectives(program) == ["ssmshard.reduce_scatter", "ssmshard.all_gather"]


def test_every_node_carries_a_placement_after_the_passes():
    program = shard(program_of(Block(), torch.randn(2, 6, 8)), MLP_PLACEMENTS, policy=SequenceParallelPolicy())
    for node in program.graph.nodes:
        if node.op == "call_function":
            assert "placement" in node.meta, node.format_node()
