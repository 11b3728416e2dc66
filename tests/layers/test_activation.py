"""ActivatedLinear: an FFN's first projection and its activation, applied by whichever kernel replaces
the linear (inside oneDNN's matmul, or in place on the output) with the values of act(linear(x))."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from encdec_engine.layers.activation import _ACTIVATIONS, ActivatedLinear, activate_output, get_activation
from encdec_engine.layers.linear import PackedLinear, fuses_activation, onednn_packing_available, pack_linears
from encdec_engine.quantization.int8_weights import Int8Linear, quantize_linears

NAMES = sorted(_ACTIVATIONS)


def _layer(name: str, bias: bool = True) -> ActivatedLinear:
    torch.manual_seed(0)
    layer = ActivatedLinear(48, 96, name, bias=bias)
    with torch.no_grad():
        layer.weight.mul_(8)  # outputs into both tails of every activation
    return layer


@pytest.mark.parametrize("name", NAMES)
def test_activated_linear_is_the_activation_of_the_linear(name):
    layer, x = _layer(name), torch.randn(7, 48)
    assert torch.equal(layer(x), get_activation(name)(F.linear(x, layer.weight, layer.bias)))
    assert set(layer.state_dict()) == {"weight", "bias"}  # the checkpoint's names, as an nn.Linear's


@pytest.mark.parametrize("name", NAMES)
def test_activate_output_gives_the_functions_values(name):
    x = torch.randn(1000) * 6
    assert torch.equal(activate_output(name, x.clone()), get_activation(name)(x))


def test_unknown_activation_fails_at_construction():
    with pytest.raises(ValueError, match="unsupported activation_function 'nope'"):
        ActivatedLinear(4, 4, "nope")


@pytest.mark.skipif(not onednn_packing_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_packed_activated_linear_equals_activation_of_packed_linear(name, bias):
    layer = _layer(name, bias)
    plain = PackedLinear(nn.Linear(48, 96, bias=bias))  # the same matmul, no activation
    plain.packed_weight, plain.bias = PackedLinear(layer).packed_weight, layer.bias
    model = nn.Sequential(layer)
    assert pack_linears(model) == 1 and isinstance(model[0], PackedLinear)
    with torch.inference_mode():  # as the engine runs (with autograd on, AVX2 machines round differently)
        for rows in (1, 5, 300):
            x = torch.randn(rows, 48)
            assert torch.equal(model(x), get_activation(name)(plain(x)))  # bit for bit, fused or not


@pytest.mark.skipif(not onednn_packing_available(), reason="torch built without oneDNN")
def test_relu_runs_inside_the_onednn_matmul():
    assert fuses_activation("relu")  # max(0, x) is exact on any machine: the probe must accept it
    assert "(fused)" in repr(PackedLinear(_layer("relu")))
    assert not fuses_activation("silu")  # no post-op registered: applied in place after the matmul
    assert "(fused)" not in repr(PackedLinear(_layer("silu")))


@pytest.mark.parametrize("name", ["relu", "gelu", "gelu_new"])
def test_int8_activated_linear_applies_its_activation(name):
    layer = _layer(name)
    model = nn.Sequential(layer)
    plain = Int8Linear(nn.Linear(48, 96))
    plain.weight_int8 = None
    assert quantize_linears(model) == 1 and isinstance(model[0], Int8Linear)
    plain.weight_int8 = model[0].weight_int8  # the same int8 matmul, no activation
    for rows in (1, 5, 600):
        x = torch.randn(rows, 48)
        assert torch.equal(model(x), get_activation(name)(plain(x)))
