"""The ``scan_outputs`` pass: Mamba-1's scan writes the dtype its output is cast to (the cast, and
the one-tensor ``cat`` of transformers >= 5.25, leave the graph) and skips the final state where
nothing reads it. Checked on the CPU with the GPU plan's passes (the kernel adapters run the
reference op on CPU tensors): bf16 models give the same logits bit for bit as with the pass
skipped, no further from Hugging Face's float32 logits than 3x HF's own bf16 run; float32
models Hugging Face's within 1e-5. The
Triton kernel's own rounding of y is checked by tests/test_kernel_selective_scan.py (y in u's
dtype), its run without a final state by that file's test_no_grad_path_and_default_config."""

import copy
import operator

import pytest
import torch

import ssmshard
from ssmshard.testing import rel_err

from conftest import pipeline_steps, small_model

ssm = torch.ops.ssmshard


def _scans(program):
    from ssmshard.passes.swap_kernels import KERNELS
    adapter = KERNELS[ssm.selective_scan.default][0]
    return [n for n in program.graph_module.graph.nodes if n.op == "call_function" and n.target is adapter]


def _output(scan, index):
    found = [u for u in scan.users if u.target is operator.getitem and u.args[1] == index]
    return found[0] if found else None


def _run(model, ids, monkeypatch, **plan):
    """Per rank: forward logits, prefill logits, the forward and the prefill program."""
    monkeypatch.setattr(ssmshard.Plan, "kernel_choice", lambda self, device: "triton")
    mesh = ssmshard.SimulatedMesh(model, ssmshard.Plan(tp=2, training=False, **plan))
    with torch.no_grad():
        logits = mesh.run(lambda dm: dm(ids))
        prefill_logits = [logits for logits, _ in mesh.prefill(ids)]
    return [(logits[r], prefill_logits[r], dm.program, dm.prefill_program()) for r, dm in enumerate(mesh.ranks)]


def _check_final_states(forward, prefill):
    """The forward reads no final state: its scans skip it; the prefill's cache reads it."""
    for scan in _scans(forward):
        assert scan.kwargs["final_state"] is False
        assert scan.meta["val"][1].shape[-1] == 0  # the empty stand-in
    for scan in _scans(prefill):
        assert "final_state" not in scan.kwargs and _output(scan, 1).users


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_bf16_scan_writes_what_is_read_with_the_same_logits(family, fresh_seed, monkeypatch):
    model = copy.deepcopy(small_model(family)).to(torch.bfloat16)  # the cached model stays float32
    generator = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=generator)
    fused = _run(model, ids, monkeypatch)
    plain = _run(model, ids, monkeypatch, skip_passes=["scan_outputs"])
    with torch.no_grad():
        exact = small_model(family)(ids).logits  # HF in float32
        # How far bf16 rounding moves HF's own logits from that: ours may land as far, in other places.
        reach = 3 * rel_err(model(ids).logits.float(), exact)
    layers = model.config.num_hidden_layers
    for rank, (got, without) in enumerate(zip(fused, plain)):
        logits, prefill_logits, forward, prefill = got
        # The rewrite changes no value: each scan rounds y once, as the cast did.
        assert torch.equal(logits, without[0]), f"rank {rank}, seed {fresh_seed}"
        assert torch.equal(prefill_logits, without[1]), f"rank {rank}, seed {fresh_seed}"
        # Against HF: no further from its float32 logits than 3x its own bf16 run is (measured over 16
        # seeds on this CPU: at most 1.6x, 0.0046 against 0.0029).
        assert rel_err(logits.float(), exact) <= reach, f"rank {rank}, seed {fresh_seed}"
        _check_final_states(forward, prefill)
        for program in (forward, prefill):
            report = program.scan_output_report
            assert len(report) == layers and all(r["out_dtype"] == "bfloat16" for r in report)
            scans = _scans(program)
            assert len(scans) == layers
            for scan in scans:
                assert scan.kwargs["out_dtype"] is torch.bfloat16
                y = _output(scan, 0)
                assert y.meta["val"].dtype is torch.bfloat16
                # Straight into out_proj's transpose: no cat, no cast left.
                assert [r.target for r in y.users] == [torch.ops.aten.transpose.int]
        for program in without[2:]:
            for scan in _scans(program):
                assert "out_dtype" not in scan.kwargs and "final_state" not in scan.kwargs
                assert _output(scan, 0).meta["val"].dtype is torch.float32


def test_fp32_scan_keeps_float32(fresh_seed, monkeypatch):
    """Nothing narrows a float32 model's scan output: y stays float32, the forward's unread final
    state still goes, and the program equals Hugging Face within 1e-5."""
    model = small_model("mamba")
    generator = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=generator)
    with torch.no_grad():
        expected = model(ids).logits
    for rank, (logits, prefill_logits, forward, prefill) in enumerate(_run(model, ids, monkeypatch)):
        assert rel_err(logits, expected) < 1e-5, f"rank {rank}, seed {fresh_seed}"
        assert rel_err(prefill_logits, expected[:, -1:]) < 1e-5, f"rank {rank}, seed {fresh_seed}"
        assert [r["out_dtype"] for r in forward.scan_output_report] == [None] * model.config.num_hidden_layers
        assert prefill.scan_output_report == []
        _check_final_states(forward, prefill)


def test_the_training_forward_is_left_alone_and_the_pass_can_be_skipped():
    """Autograd differentiates a training forward's scan in float32: the pass is not in it."""
    assert "scan_outputs" not in pipeline_steps(ssmshard.Plan(tp=2), "forward")
    inference = ssmshard.Plan(tp=2, training=False)
    for mode in ("forward", "prefill", "chunk"):
        assert "scan_outputs" in pipeline_steps(inference, mode)
    assert "scan_outputs" in pipeline_steps(ssmshard.Plan(tp=2), "prefill")
    assert "scan_outputs" not in pipeline_steps(ssmshard.Plan(tp=2, training=False), "decode")
    skipped = ssmshard.Plan(tp=2, training=False, skip_passes=["scan_outputs"])
    assert "scan_outputs" not in pipeline_steps(skipped, "forward")
