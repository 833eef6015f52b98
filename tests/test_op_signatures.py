"""Each SSM op's arguments are declared once (``ssmshard.ops.signatures``): the registered op,
the reference, the Triton entry points behind ``swap_kernels`` and the Hugging Face shims are
checked against that declaration here."""

import importlib
import inspect
import types

import pytest
import torch

from ssmshard import hf_shims
from ssmshard.families import FAMILIES
from ssmshard.kernels import reference
from ssmshard.ops import SIGNATURES
from ssmshard.passes import swap_kernels

from test_ops import EXPORT_CASES

ssm = torch.ops.ssmshard


@pytest.mark.parametrize("name", SIGNATURES)
def test_registered_schema_is_the_declaration(name):
    signature = SIGNATURES[name]
    assert str(getattr(ssm, name).default._schema) == signature.qualname + signature.schema


@pytest.mark.parametrize("name", SIGNATURES)
def test_reference_takes_the_declared_arguments_in_order(name):
    """The op runs its reference with the arguments in schema order; anything after them is an
    option of the reference alone and has a default."""
    parameters = list(inspect.signature(getattr(reference, name)).parameters.values())
    names = SIGNATURES[name].names
    assert tuple(p.name for p in parameters[:len(names)]) == names
    assert all(p.default is not inspect.Parameter.empty for p in parameters[len(names):])


def test_bind_names_every_argument_and_refuses_unknown_ones():
    signature = SIGNATURES["causal_conv1d"]
    x, w = torch.zeros(1), torch.zeros(1)
    assert signature.bind((x, w), {"bias": None, "activation": "silu"}) == {
        "x": x, "weight": w, "bias": None, "activation": "silu", "cu_seqlens": None}
    with pytest.raises(TypeError, match="unexpected.*'seq_idx'"):
        signature.bind((x, w, None, None), {"seq_idx": None})
    with pytest.raises(TypeError, match="missing argument 'activation'"):
        signature.bind((x, w, None), {})


class _Recorder:
    """Stands in for a Triton entry point: binds each call against the real function's
    signature (a mismatch raises here) and returns placeholders of the op's outputs."""

    def __init__(self, real, outputs):
        self.signature, self.outputs, self.calls = inspect.signature(real), outputs, []

    def __call__(self, *args, **kwargs):
        self.calls.append(self.signature.bind(*args, **kwargs).arguments)
        return self.outputs


@pytest.mark.parametrize("target", list(swap_kernels.KERNELS), ids=lambda t: t.name())
def test_kernel_adapters_hand_every_argument_to_their_triton_entry_point(target, monkeypatch):
    adapter, module_name, _ = swap_kernels.KERNELS[target]
    name = target.name().split("::")[1].split(".")[0]
    # FX code generation finds the adapter under its own name in the pass module.
    assert getattr(swap_kernels, adapter.__name__) is adapter and adapter.__name__ == f"{name}_kernel"
    module = importlib.import_module(module_name)
    real = getattr(module, name)
    two_outputs = len(getattr(ssm, name).default._schema.returns) == 2
    recorder = _Recorder(real, (torch.zeros(1), torch.zeros(2)) if two_outputs else torch.zeros(1))
    monkeypatch.setattr(module, name, recorder)
    monkeypatch.setattr(swap_kernels, "_on_gpu", lambda t: True)
    args = EXPORT_CASES[name]
    with torch.no_grad():
        adapter(*args)
    (passed,) = recorder.calls
    for arg_name, value in SIGNATURES[name].bind(args, {}).items():
        if arg_name in ("dt_min", "dt_max"):  # the kernel takes them as one dt_limit pair
            assert passed["dt_limit"][("dt_min", "dt_max").index(arg_name)] == value
        elif arg_name == "out_dtype":  # the op's None is float32
            assert passed[arg_name] is (value or torch.float32)
        elif arg_name == "final_state":  # the kernel's name for it
            assert passed["return_final_state"] is value
        else:
            assert passed[arg_name] is value, arg_name


class _OpRecorder:
    """Stands in for ``torch.ops.ssmshard``: records each call's keyword arguments."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            assert not args, f"{name} must be called by argument name"
            self.calls.append((name, kwargs))
            two_outputs = len(getattr(ssm, name).default._schema.returns) == 2
            return (torch.zeros(1), torch.zeros(1)) if two_outputs else torch.zeros(1)
        return call


_HF_VALUES = {"chunk_size": 4, "dt_limit": (0.0, 2.0), "activation": "silu", "delta_softplus": True,
              "dt_softplus": True, "return_last_state": True, "return_final_states": True}


def _plain_function(hf_object):
    """HF's function itself: from transformers 5.25 the modeling module's name is a `kernels` hub
    wrapper, an nn.Module whose forward takes (*args, **kwargs) and calls the function."""
    if not isinstance(hf_object, torch.nn.Module):
        return hf_object
    forward = type(hf_object).forward
    return dict(zip(forward.__code__.co_freevars, forward.__closure__))["func"].cell_contents


def _hf_calls():
    """(family, HF function name, its signature) for every shimmed function HF's modules call."""
    calls = {}
    for family in FAMILIES.values():
        module = importlib.import_module(family.modeling_module)
        for hf_name, shim in hf_shims.SHIMS.items():
            if shim is not hf_shims.fused_path_unavailable and callable(getattr(module, hf_name, None)):
                signature = inspect.signature(_plain_function(getattr(module, hf_name)))
                calls[(hf_name, str(signature))] = (family.name, hf_name, signature)
    return sorted(calls.values(), key=lambda c: c[:2])


@pytest.mark.parametrize("family, hf_name, hf_signature", _hf_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_hf_shims_take_hf_arguments_and_pass_every_op_argument(family, hf_name, hf_signature, monkeypatch):
    """Called as HF calls it, each shim passes every argument of its op by its declared name,
    and every tensor HF hands over reaches the op."""
    recorder = _OpRecorder()
    monkeypatch.setattr(hf_shims, "_ssm", recorder)
    kwargs = {}
    for p in hf_signature.parameters.values():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if p.name in _HF_VALUES:
            kwargs[p.name] = _HF_VALUES[p.name]
        elif isinstance(p.default, bool):
            kwargs[p.name] = p.default  # HF's own switches (use_mambapy, ...): left as HF leaves them
        else:
            kwargs[p.name] = torch.zeros(1)
    hf_shims.SHIMS[hf_name](**kwargs)
    (op_name, passed), = recorder.calls
    assert set(passed) == set(SIGNATURES[op_name].names), (op_name, sorted(passed))
    handed = {id(v) for v in kwargs.values() if isinstance(v, torch.Tensor)}
    assert handed <= {id(v) for v in passed.values()}, f"{hf_name}: an HF tensor argument does not reach {op_name}"


def test_gated_norm_shim_passes_every_op_argument(monkeypatch):
    recorder = _OpRecorder()
    monkeypatch.setattr(hf_shims, "_ssm", recorder)
    norm = types.SimpleNamespace(weight=torch.ones(4), variance_epsilon=1e-6, group_size=2)
    hf_shims.gated_rms_norm_forward(norm, torch.zeros(1, 4), torch.zeros(1, 4))
    (op_name, passed), = recorder.calls
    assert op_name == "gated_rms_norm" and set(passed) == set(SIGNATURES[op_name].names)
