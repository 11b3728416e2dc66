"""Activation functions by their Hugging Face config names, and the linear an FFN applies one after.

An FFN's first projection writes a [tokens, 4 x d_model] tensor that the activation then reads
again: for an encoder batch that is the largest tensor of the layer. `ActivatedLinear` keeps the
activation with its linear, so that the kernel replacing it (oneDNN's packed fp32 linears, the
int8 ones) applies it to its own output: inside the matmul where oneDNN has the same function
(relu, gelu), in place otherwise. The values are those of `act(linear(x))` bit for bit
(`tests/layers/test_activation.py`); what goes is a second tensor and one pass over memory
(T5-base's encoder, fp32: ReLU 1.3 s of 19 s on the text benchmark).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """HF's NewGELUActivation op for op: `F.gelu(approximate="tanh")` differs from it in the last bits."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}


# The same functions, overwriting their input: for a tensor nothing else holds (a linear's output).
_IN_PLACE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": torch.ops.aten.gelu_,
    "gelu_pytorch_tanh": partial(torch.ops.aten.gelu_, approximate="tanh"),
    "relu": torch.relu_,
    "silu": partial(F.silu, inplace=True),
    "swish": partial(F.silu, inplace=True),
    "tanh": torch.tanh_,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation_function {name!r}; known: {sorted(_ACTIVATIONS)}") from None


def activate_output(name: str, x: torch.Tensor) -> torch.Tensor:
    """`get_activation(name)(x)` for an `x` the caller owns: in place where the function has that form."""
    in_place = _IN_PLACE.get(name)
    return get_activation(name)(x) if in_place is None else in_place(x)


class ActivatedLinear(nn.Linear):
    """act(x @ weight.T + bias): an `nn.Linear` (same parameters, same checkpoint names) that carries
    the activation applied to its output, for the kernels that replace it to apply themselves."""

    def __init__(self, in_features: int, out_features: int, activation: str, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        get_activation(activation)  # an unknown name fails here, at construction
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activate_output(self.activation, super().forward(x))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"
