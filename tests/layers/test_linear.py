"""CPU fp32 linears through oneDNN's packed layout: same results as F.linear up to summation order."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from encdec_engine.machine.cpu_kernels import machine_plan
from encdec_engine.layers.linear import (PackedLinear, bf16_native, PackedWeight, VocabProjection, onednn_packing_available,
                                         pack_linears)
from encdec_engine.worker.kv_sizing import weight_bytes

pytestmark = pytest.mark.skipif(not onednn_packing_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(0, 48), (1, 48), (5, 48), (2, 3, 48), (300, 48)])
def test_packed_linear_matches_f_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(shape)
    expected = F.linear(x, linear.weight, linear.bias)
    got = PackedLinear(linear)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_pack_linears_swaps_cpu_fp32_linears_and_native_bf16_ones():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4), nn.ReLU()), nn.Linear(4, 4).bfloat16(),
                          nn.Linear(4, 4).half())
    x = torch.randn(3, 8)
    expected = model[1](model[0](x))
    half = model[2](expected.bfloat16())
    assert pack_linears(model) == 2 + bf16_native()  # bf16 only where oneDNN multiplies it natively
    assert [type(m) for m in (model[0], model[1][0], model[2], model[3])] == \
        [PackedLinear, PackedLinear, PackedLinear if bf16_native() else nn.Linear, nn.Linear]
    torch.testing.assert_close(model[1](model[0](x)), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[2](expected.bfloat16()), half)
    assert weight_bytes(model) == 4 * (8 * 8 + 8 + 8 * 4 + 4) + 2 * 2 * (4 * 4 + 4)  # packed weights by their size


def test_vocab_projection_follows_weight_changes():
    torch.manual_seed(0)
    weight, hidden = torch.randn(100, 16), torch.randn(2, 16)
    project = VocabProjection()
    project.use(PackedWeight)
    torch.testing.assert_close(project(hidden, weight), hidden @ weight.T, rtol=1e-5, atol=1e-5)
    weight.mul_(-2)  # in place: a new version of the same storage
    torch.testing.assert_close(project(hidden, weight), hidden @ weight.T, rtol=1e-5, atol=1e-5)
    other = torch.randn(100, 16)  # replaced
    torch.testing.assert_close(project(hidden, other), hidden @ other.T, rtol=1e-5, atol=1e-5)
    half = other.half()  # not packed: plain F.linear
    torch.testing.assert_close(project(hidden.half(), half), F.linear(hidden.half(), half))
    bf16 = other.bfloat16()  # packed where native
    torch.testing.assert_close(project(hidden.bfloat16(), bf16), F.linear(hidden.bfloat16(), bf16))


def test_loaded_cpu_model_runs_the_machines_fp32_kernel(bart_path, make_llm):
    model = make_llm(bart_path).engine.model
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    packed = machine_plan(int8=False).fp32 == "onednn"  # else MKL: the linears (an FFN's ActivatedLinear too) as built
    assert linears and all(isinstance(m, PackedLinear) == packed for m in linears)
