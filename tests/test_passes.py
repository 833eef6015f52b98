"""The pass framework: registration, pipelines, verification, op-count diffs, dumps, skipping."""

import operator

import pytest
import torch

import ssmshard
from ssmshard import passes
from ssmshard.testing import rel_err

from conftest import small_model


@pytest.fixture
def program():
    return ssmshard.capture(small_model("mamba"))


@pytest.fixture
def scoped_pass():
    """Register passes for one test only."""
    names = []

    def add(name, fn, **kw):
        passes.register(name, fn, replace=True, **kw)
        names.append(name)
        return fn

    yield add
    for name in names:
        passes.unregister(name)


def _double_then_halve_scan_outputs(program, ctx):
    """A user pass that really rewrites the graph: out -> (out * 2) * 0.5 after every scan."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0 \
                and node.args[0].meta["ssmshard"]["role"] == "scan":
            users = list(node.users)
            with graph.inserting_after(node):
                doubled = graph.call_function(torch.ops.aten.mul.Tensor, (node, 2.0))
            with graph.inserting_after(doubled):
                halved = graph.call_function(torch.ops.aten.mul.Tensor, (doubled, 0.5))
            for new in (doubled, halved):
                new.meta["ssmshard"] = dict(node.meta["ssmshard"])
            for user in users:
                user.replace_input_with(node, halved)
    return program


def test_user_registered_pass_runs_and_records_op_diff(program, scoped_pass, fresh_seed):
    scoped_pass("double_then_halve", _double_then_halve_scan_outputs)
    ids = torch.randint(0, 256, (2, 9))
    before = program(ids)
    out = passes.run_pipeline(program, ["double_then_halve"])
    assert out.history[-1]["pass"] == "double_then_halve"
    assert out.history[-1]["op_diff"] == {"mul": 4}  # two scans, two muls each
    assert rel_err(out(ids), before) < 1e-6


def test_decorator_registration_and_options(program, scoped_pass):
    seen = {}

    @passes.register("record_options")
    def record_options(program, ctx):
        seen.update(ctx.options)
        return program

    try:
        passes.run_pipeline(program, [("record_options", {"threshold": 3})])
        assert seen == {"threshold": 3}
        assert "record_options" in passes.registered()
    finally:
        passes.unregister("record_options")


def test_duplicate_registration_is_refused(scoped_pass):
    scoped_pass("only_once", lambda p, c: p)
    with pytest.raises(ValueError, match="already registered"):
        passes.register("only_once", lambda p, c: p)


def test_verifier_names_the_pass_that_corrupts_the_graph(program, scoped_pass):
    def break_shapes(program, ctx):
        # Feed in_proj's (b, l, 2d) output where out_proj expects (b, l, d).
        linears = {n.meta["ssmshard"]["role"]: n for n in program.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten.linear.default}
        out_proj = linears["out_proj"]
        out_proj.args = (linears["in_proj"], *out_proj.args[1:])
        return program

    scoped_pass("break_shapes", break_shapes)
    with pytest.raises(passes.PassVerificationError, match="break_shapes"):
        passes.run_pipeline(program, ["break_shapes"])


def test_verifier_catches_lost_tags_and_malformed_graphs(program, scoped_pass):
    def drop_tags(program, ctx):
        next(n for n in program.graph.nodes if n.op == "call_function").meta.pop("ssmshard")
        return program

    def dangling_use(program, ctx):
        graph = program.graph
        first = next(n for n in graph.nodes if n.op == "call_function")
        # A node used before it is defined: lint must reject the graph.
        with graph.inserting_before(first):
            user = graph.call_function(torch.ops.aten.neg.default, (first,))
        user.meta["ssmshard"] = dict(first.meta["ssmshard"])
        return program

    scoped_pass("drop_tags", drop_tags)
    scoped_pass("dangling_use", dangling_use)
    with pytest.raises(passes.PassVerificationError, match="drop_tags.*tags"):
        passes.run_pipeline(program, ["drop_tags"])
    with pytest.raises(passes.PassVerificationError, match="dangling_use"):
        passes.run_pipeline(ssmshard.capture(small_model("mamba")), ["dangling_use"])


def test_skip_by_name_and_debug_dumps(program, scoped_pass, tmp_path):
    calls = []
    scoped_pass("noted", lambda p, c: calls.append(1) or p)
    passes.run_pipeline(program, ["noted", "tag"], skip={"noted"}, debug_dir=str(tmp_path))
    assert calls == []
    assert program.history[-2] == {"pass": "noted", "skipped": True}
    assert sorted(f.name for f in tmp_path.iterdir()) == ["01_tag_after.txt", "01_tag_before.txt"]
    assert "ssd_scan" not in (tmp_path / "01_tag_after.txt").read_text()
    assert "selective_scan" in (tmp_path / "01_tag_after.txt").read_text()


def test_unknown_pass_lists_registered_ones(program):
    with pytest.raises(KeyError, match="tag"):
        passes.run_pipeline(program, ["no_such_pass"])


def test_bucket_siblings_replay_the_pipeline(scoped_pass, fresh_seed):
    """A shape-bucket sibling captured later gets the same passes as the program it serves."""
    scoped_pass("double_then_halve", _double_then_halve_scan_outputs)
    model = small_model("mamba")
    prefill = passes.run_pipeline(ssmshard.capture(model, mode="prefill"), ["double_then_halve"])
    ids = torch.randint(0, 256, (2, 2))  # shorter than the conv kernel: a new bucket
    logits, _ = prefill(ids)
    (sibling,) = prefill.siblings
    assert [h["pass"] for h in sibling.history] == [*passes.CAPTURE_PASSES, "double_then_halve"]
    with torch.no_grad():
        assert rel_err(logits, model(ids).logits[:, -1:]) < 1e-5  # prefill returns the last position


def test_verifier_catches_a_break_after_a_propagation_it_can_reuse(program, scoped_pass):
    """The verifier recomputes only what changed since its last propagation: a pass after a
    verified one that breaks a single edge is still caught."""
    def break_shapes(program, ctx):
        linears = {n.meta["ssmshard"]["role"]: n for n in program.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten.linear.default}
        linears["out_proj"].args = (linears["in_proj"], *linears["out_proj"].args[1:])
        return program

    scoped_pass("unchanged", lambda p, c: p)
    scoped_pass("break_shapes", break_shapes)
    passes.run_pipeline(program, ["unchanged"])  # a full propagation the next one reuses
    with pytest.raises(passes.PassVerificationError, match="break_shapes"):
        passes.run_pipeline(program, ["break_shapes"])


def test_verifier_reuses_alike_layers_values_and_catches_a_break_in_the_last(scoped_pass, monkeypatch):
    """Within one propagation a node with the same op and alike inputs as an earlier one takes its
    value (fake_values.py): fewer ops run than the program has, and a break in the last of four
    alike layers is still caught, its inputs no longer being alike."""
    from ssmshard.passes import fake_values

    computed = []
    real = fake_values.FakeTensorProp.run_node
    monkeypatch.setattr(fake_values.FakeTensorProp, "run_node",
                        lambda self, n: (computed.append(n.op == "call_function"), real(self, n))[1])
    scoped_pass("refresh", lambda p, c: p)
    program = ssmshard.capture(small_model("mamba", num_hidden_layers=4))
    computed.clear()
    passes.run_pipeline(program, ["refresh"])
    calls = sum(1 for n in program.graph.nodes if n.op == "call_function")
    assert 0 < sum(computed) < calls * 0.6, (sum(computed), calls)

    def break_last_layer(program, ctx):
        linears = {n.meta["ssmshard"]["role"]: n for n in program.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten.linear.default
                   and n.meta["ssmshard"].get("layer") == 3}
        linears["out_proj"].args = (linears["in_proj"], *linears["out_proj"].args[1:])
        return program

    scoped_pass("break_last_layer", break_last_layer)
    with pytest.raises(passes.PassVerificationError, match="break_last_layer"):
        passes.run_pipeline(ssmshard.capture(small_model("mamba", num_hidden_layers=4)), ["break_last_layer"])


def _described(val):
    values = val if isinstance(val, (tuple, list)) else [val]
    return [(str(v.shape), str(v.stride()), v.dtype) for v in values if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("family", ["mamba", "llama"])
def test_changed_only_propagation_writes_what_a_full_one_does(family, monkeypatch):
    """After the sharding passes (tp=2), every node's fake value is what propagating every node
    after every pass (SSMSHARD_FULL_PROPAGATION=1) gives."""
    from ssmshard.runtime.pipeline import shard_program

    model, plan = small_model(family), ssmshard.Plan(tp=2)

    def sharded_decode():
        prefill = shard_program(ssmshard.capture(model, mode="prefill"), model, plan, rank=1, group="fake_values")
        return shard_program(ssmshard.capture(model, mode="decode"), model, plan, rank=1, group="fake_values",
                             prefill=prefill)

    monkeypatch.setenv("SSMSHARD_FULL_PROPAGATION", "1")
    full = sharded_decode()
    monkeypatch.setenv("SSMSHARD_FULL_PROPAGATION", "0")
    changed_only = sharded_decode()
    full_nodes, changed_nodes = list(full.graph.nodes), list(changed_only.graph.nodes)
    assert [n.name for n in full_nodes] == [n.name for n in changed_nodes]
    assert sum(1 for n in full_nodes if isinstance(n.meta.get("val"), torch.Tensor)) > 100
    for a, b in zip(full_nodes, changed_nodes):
        assert _described(a.meta.get("val")) == _described(b.meta.get("val")), a.name


def test_the_code_is_regenerated_after_a_pass_that_changes_the_graph_only(program, scoped_pass, monkeypatch, fresh_seed):
    """run_pipeline regenerates the module's Python code when a pass changed a node (here: one
    argument of one node), once per pipeline, and not after a pass that changed nothing."""
    recompiles = []
    real = torch.fx.GraphModule.recompile
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", lambda self: (recompiles.append(self), real(self))[1])
    scoped_pass("looks_only", lambda p, ctx: (p.op_counts(), p)[1])
    passes.run_pipeline(program, ["looks_only"])
    assert recompiles == []

    def zero_the_logits(p, ctx):
        output = next(n for n in p.graph.nodes if n.op == "output")
        logits = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
        with p.graph.inserting_before(output):
            zeros = p.graph.call_function(torch.ops.aten.mul.Tensor, (logits, 0.0))
        zeros.meta["ssmshard"] = dict(logits.meta["ssmshard"])
        output.replace_input_with(logits, zeros)
        return p

    scoped_pass("zero_the_logits", zero_the_logits)
    ids = torch.randint(0, 256, (2, 5))
    assert program(ids).abs().sum() > 0
    # Two changing passes in one pipeline: the code is regenerated once, at the end.
    passes.run_pipeline(program, ["zero_the_logits", "looks_only", "zero_the_logits"])
    assert recompiles.count(program.graph_module) == 1
    assert program(ids).abs().sum() == 0
    # A caller that runs several pipelines (shard_program) asks for it once, after the last.
    recompiles.clear()
    passes.run_pipeline(program, ["zero_the_logits"], recompile=False)
    assert recompiles == [] and program.code_stale
    passes.manager.regenerate_code(program)
    assert recompiles == [program.graph_module] and not program.code_stale
