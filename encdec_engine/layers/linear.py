"""CPU fp32 matmuls through oneDNN, with each weight packed once after loading; the vocab head.

torch's `F.linear` on the CPU calls MKL, and MKL keeps AMD CPUs on its AVX2 kernels. oneDNN
(which torch also ships, and which inductor uses for frozen CPU linears) runs AVX-512 there
and takes the weight pre-packed into its blocked layout. Measured on a 2-core AMD EPYC with
AVX-512, fp32 (ms, `F.linear` -> packed):

    shape (in -> out)   rows   F.linear   packed
    384 -> 1,536           1      0.040    0.029
    384 -> 1,536       1,500      7.85     3.37     (a Whisper window through the encoder)
    4,096 -> 1,024        16      1.10     0.30
    384 -> 51,864          1      5.24     1.31     (tiny.en's output head, one decode row)
    384 -> 51,864         16      9.81     2.19

On an AVX2-only EPYC the two are about even, so whether to pack is decided per machine
(`machine/cpu_kernels.py`). The results differ from `F.linear` only in summation order (~1e-6
relative). Elsewhere (CUDA, other dtypes, a torch built without oneDNN) everything stays on
`F.linear`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import cache

import torch
from torch import nn

from encdec_engine.layers.activation import ActivatedLinear, activate_output, get_activation

_PACK_ROWS = 64  # row count oneDNN picks its packed layout for; measured best from 1 to 1,500 rows

# Turns an [out, in] weight (and bias) into a callable x: [..., in] -> [..., out].
WeightKernel = Callable[[torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]]


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@cache
def bf16_native() -> bool:
    """Whether oneDNN multiplies bf16 natively here (AVX-512 BF16 or AMX), not by emulation."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return check is not None and bool(check())


def packs(weight: torch.Tensor) -> bool:
    """Whether `weight` ([out, in]) can run through the packed oneDNN path: fp32, or bf16 where oneDNN
    multiplies bf16 natively (emulated it is slower than `F.linear`)."""
    return (weight.device.type == "cpu" and onednn_packing_available()
            and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_native())))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of an [out, in] weight (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for x: [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Activations oneDNN applies inside the matmul (a post-op), as its `_linear_pointwise` names them.
_POST_OPS = {"relu": ("relu", ""), "gelu": ("gelu", "none")}


@cache
def fuses_activation(name: str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's post-op for the activation `name` gives `get_activation(name)`'s values bit for
    bit on this machine in `dtype` (its kernels differ by CPU, so it is checked here, once, not assumed;
    in bf16 the post-op acts before the output's rounding, so it does not)."""
    if name not in _POST_OPS or not onednn_packing_available():
        return False
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 32, generator=generator) * 4).to(dtype)  # outputs well into both tails
    weight = (torch.randn(512, 32, generator=generator) / 4).to(dtype)
    packed = pack_weight(weight)
    fused = torch.ops.mkldnn._linear_pointwise(x, packed, None, _POST_OPS[name][0], [], _POST_OPS[name][1])
    return torch.equal(fused, get_activation(name)(packed_linear(x, packed, None)))


class PackedWeight:
    """An fp32 [out, in] weight in oneDNN's packed layout, ready for x @ w.T + b."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed, self.bias = pack_weight(weight), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight lives only in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", pack_weight(linear.weight), persistent=False)
        self.bias = linear.bias
        self.activation: str | None = getattr(linear, "activation", None)  # an ActivatedLinear's
        fuses = self.activation and fuses_activation(self.activation, linear.weight.dtype)
        self._post_op = _POST_OPS[self.activation] if fuses \
            else ("none", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attr, algorithm = self._post_op
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, attr, [], algorithm)
        if self.activation is None or attr != "none":
            return out
        return activate_output(self.activation, out)

    def extra_repr(self) -> str:
        fused = "" if self.activation is None else f", activation={self.activation}" + (
            " (fused)" if self._post_op[0] != "none" else "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + fused)


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module],
                    applies: Callable[[torch.Tensor], bool], skip: Collection[nn.Module] = ()) -> int:
    """Replace every `nn.Linear` (an ActivatedLinear included: `make` reads its `activation`) whose
    weight `applies` (and that is not in `skip`) with `make(linear)`; returns how many.

    Called once, after the weights are loaded and moved: a replaced layer no longer holds
    `weight`, so a later load or `.to()` must not follow.
    """
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) in (nn.Linear, ActivatedLinear) and applies(child.weight)
             and not any(child is m for m in skip)]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)


def pack_linears(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace every CPU `nn.Linear` that `packs` (fp32; bf16 where native; only those of `dtype` if given) with
    a PackedLinear; returns how many."""
    return replace_linears(model, PackedLinear, lambda w: packs(w) and dtype in (None, w.dtype))


class VocabProjection:
    """Logits = hidden @ weight.T for an output head of shape [vocab, hidden].

    The head is often tied to the input embedding, which keeps its plain float layout (the
    lookup needs it), so a kernel that wants the weight in another form (oneDNN-packed, int8)
    gets its own copy beside it (`use`), refreshed if the weight is replaced or changed in
    place. Without one (and for weights the kernel does not take) it is `F.linear`.
    """

    def __init__(self) -> None:
        self._kernel: WeightKernel | None = None
        self._applies: Callable[[torch.Tensor], bool] = packs
        self._prepared: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._key: tuple | None = None

    def use(self, kernel: WeightKernel | None, applies: Callable[[torch.Tensor], bool] = packs) -> None:
        """Project through `kernel(weight, None)` for weights that `applies`; None: F.linear."""
        self._kernel, self._applies, self._prepared, self._key = kernel, applies, None, None

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """hidden @ weight.T (+ bias, added by the kernel: one pass over the logits, not two)."""
        if self._kernel is None or not self._applies(weight):
            return nn.functional.linear(hidden, weight, bias)
        key = (weight.data_ptr(), weight._version, weight.shape,
               None if bias is None else (bias.data_ptr(), bias._version))
        if self._key != key:  # loaded, or changed since
            self._prepared, self._key = self._kernel(weight, bias), key
        return self._prepared(hidden)
