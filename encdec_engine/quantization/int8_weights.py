"""CPU linears on int8 weights with one scale per output channel (`quantization="int8"`).

Weights are quantized once, at load: symmetric, per output row,

    scale[o] = max_i |w[o, i]| / 127        q[o, i] = round(w[o, i] / scale[o])   (int8, -127..127)

the layout CTranslate2 stores in its int8 exports (`q = round(w * 127 / amax)` per row). A
checkpoint imported from such an export holds exactly `q / ct2_scale`, and requantizing it gives
back CTranslate2's own int8 values (every row's largest |q| is 127), so nothing is lost twice.

Two of torch's CPU int8 kernels multiply them (`worker/cpu_kernels.py` picks per machine):

    fbgemm     `quantized::linear_dynamic`: each call quantizes the activations to 8 bits (one
               scale per call) and runs an int8 x int8 GEMM. Every row count; batches go in
               chunks of `ACTIVATION_ROWS` rows, each with its own scale. Where AVX2's u8 x s8
               pair sums would saturate int16 (no VNNI), the activations keep 7 bits of range
               (`reduce_range`); where the full range sums exactly (`fbgemm_full_range`, checked
               per machine), all 8: on a VNNI Xeon 7 bits turned "Stella" into "Taylor".
    int8pack   `torch._weight_int8pack_mm`: weight-only int8, fp32 activations. Vectorized for
               AVX-512 only; there it may beat fbgemm on decode rows (few rows: memory bound).

and a third the linears whose inputs have outliers (`RowScaledInt8Weight`, below):

    rows       each row of the activations quantized to 8 bits with a scale of its own, an int8 x
               int8 GEMM with int32 sums (`torch._int_mm`, oneDNN), both scales applied after.

One activation scale over a whole batch lets its loudest input set every input's step: 44
clips transcribed as one batch (66,000 encoder rows in one call) gave the fp32 tokens on 26
clips and 9.8% WER against fp32's 9.1%; with 512-row chunks, 39 clips and 8.2% (128 and 256
rows: the same). Within a chunk a row's result still depends slightly on the rows beside it;
fp32 keeps the engine's batch invariance, int8 trades it for speed. With a scale per row (the
`rows` kernel) a row's result depends on that row alone, and one loud position costs only its own
row its precision: Whisper's encoder fc2, whose input (the GELU of 1,500 positions) reaches 556
where most values are below 1, ran in fp32 beside fbgemm's blocks; it runs here.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from contextlib import contextmanager
from functools import cache, partial

import torch
from torch import nn

from encdec_engine.layers.activation import activate_output
from encdec_engine.layers.linear import replace_linears

INT8_MAX = 127  # symmetric range: -127..127 (CTranslate2's, and fbgemm's qint8 without -128)
ACTIVATION_ROWS = 512  # rows sharing one activation scale (a third of a Whisper window)
# The op's C++ entry: the Python packet first scans every argument for fake script objects
# (tracing only), ~5 us of a ~35 us decode-row call.
_linear_dynamic = getattr(torch.ops.quantized.linear_dynamic, "_op", torch.ops.quantized.linear_dynamic)
# Called with the subclass __torch_function__ check off: otherwise torch's binding asks the packed
# weight (a ScriptObject) for `__torch_function__` at every call, and the failed lookup throws and
# catches a C++ exception, ~14 of a decode row's ~19 us (24 decoder linears + the head a tiny.en step).
# The engine passes plain tensors here, which have no __torch_function__ of their own to skip.
_plain_tensors = torch._C.DisableTorchFunctionSubclass


_QUANTIZE_ROWS = 1024  # rows quantized at a time: their float temporaries stay in cache (1.5 MB for tiny.en)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (q: [out, in] int8, scale: [out] float32) with weight ~= q * scale[:, None].

    Done in blocks of rows (each row is independent, so the result is the same): on the whole
    51,864 x 384 vocab head, the five elementwise passes over fresh 80 MB temporaries took 0.14 s
    against 0.03 s in blocks."""
    w = weight.detach()
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for start in range(0, w.shape[0], _QUANTIZE_ROWS):
        rows = slice(start, start + _QUANTIZE_ROWS)
        block = w[rows].float()
        amax = block.abs().amax(dim=1)
        scale[rows] = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))  # an all-zero row keeps q = 0
        q[rows] = torch.round(block / scale[rows, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q, scale


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


@contextmanager
def _fbgemm_engine():
    """Prepack under the fbgemm engine: the packed object then carries fbgemm's kernel with it,
    whatever the global engine is when it runs."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def fbgemm_pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's packed form of an int8 [out, in] weight with per-row scales (an opaque object)."""
    zero_points = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # torch 2.13 marks quantized tensors deprecated; linear_prepack still takes nothing else.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
    with _fbgemm_engine():
        return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())


def fbgemm_unpack(packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(q: [out, in] int8, scale: [out] float32) back from fbgemm's packed form."""
    qweight, _ = torch.ops.quantized.linear_unpack(packed)
    return qweight.int_repr(), qweight.q_per_channel_scales().float()


class Int8Weight:
    """An int8 [out, in] weight (+ float bias) ready for x @ w.T + b, x: [..., in] -> [..., out] float32.

    Rows up to `decode_rows` go through `decode_kernel`, more through fbgemm (see module doc).
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 decode_kernel: str = "fbgemm", decode_rows: int = 16) -> None:
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"expected an int8 [out, in] weight and [out] scales, got {q.dtype} "
                             f"{tuple(q.shape)} and {tuple(scale.shape)}")
        if decode_kernel not in ("fbgemm", "int8pack"):
            raise ValueError(f"unknown int8 decode kernel {decode_kernel!r}")
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.bias = None if bias is None else bias.detach().float()
        self.packed = fbgemm_pack(q, scale, self.bias)
        self.reduce_range = not fbgemm_full_range()  # 7-bit activations where 8 would saturate
        self.decode_kernel, self.decode_rows = decode_kernel, decode_rows
        # Weight-only kernel: its own plain copy (the fbgemm one is in a blocked layout).
        self.q, self.scale = (q.contiguous(), scale.float()) if decode_kernel == "int8pack" else (None, None)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **kernel) -> Int8Weight:
        q, scale = quantize_per_channel(weight)
        return cls(q, scale, bias, **kernel)

    def int8_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q: [out, in] int8, scale: [out] float32) as multiplied."""
        return fbgemm_unpack(self.packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if self.q is not None and 0 < rows <= self.decode_rows:
            out = torch._weight_int8pack_mm(x.reshape(rows, self.in_features).float(), self.q, self.scale)
            out = out if self.bias is None else out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        if rows <= ACTIVATION_ROWS:
            with _plain_tensors():
                return _linear_dynamic(x.float(), self.packed, self.reduce_range)
        flat = x.reshape(rows, self.in_features).float()
        with _plain_tensors():
            out = torch.cat([_linear_dynamic(flat[i : i + ACTIVATION_ROWS], self.packed, self.reduce_range)
                             for i in range(0, rows, ACTIVATION_ROWS)])
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """Memory of the weight (int8 values, scales, bias; both copies with the weight-only kernel)."""
        one = self.in_features * self.out_features + 4 * self.out_features
        extra = 0 if self.bias is None else 4 * self.out_features
        return one * (2 if self.q is not None else 1) + extra


_ROW_CHUNK = 2048  # rows quantized and multiplied at a time: a Whisper window's 1,500 in one go


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, in] float -> (q: [rows, in] int8, scale: [rows, 1] float32) with x ~= q * scale, one
    symmetric scale per row (an all-zero row gets scale 1 and q = 0)."""
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    return torch.mul(x, scale.reciprocal()).round_().to(torch.int8), scale  # one pass fewer than x / scale


@cache
def fbgemm_full_range() -> bool:
    """Whether fbgemm's dynamic linear sums 8-bit activations exactly on this machine, so that they need
    not be cut to 7 bits (`reduce_range`). Without VNNI its u8 x s8 kernels add pairs of products in
    16 bits, which saturate at the top of the range; with VNNI (vpdpbusd) the sums are 32-bit. Checked
    on the largest pair sums there are: activations at 255 of 255 against weights of +-127, where a
    saturating kernel is off by thousands of steps."""
    if not fbgemm_available():
        return False
    rows, features = 4, 256
    steps = torch.full((rows, features), 255.0)
    steps[:, 0] = 0.0  # the range [0, 1] in steps of 1/255: every activation quantizes exactly
    q = torch.full((64, features), INT8_MAX, dtype=torch.int8)
    q[1::2] = -INT8_MAX
    x = steps / 255
    want = x.double() @ q.double().T
    with _plain_tensors():
        got = _linear_dynamic(x, fbgemm_pack(q, torch.ones(64), None), False)
    return bool(torch.allclose(got.double(), want, rtol=0, atol=1e-3 * features))


@cache
def int_mm_is_exact() -> bool:
    """Whether `torch._int_mm` sums full-range int8 products exactly on this machine. oneDNN's int8
    kernels on CPUs without VNNI may add pairs of products in 16 bits, which saturate for inputs
    using all 8 bits; the `rows` kernel is only used where this holds."""
    if not hasattr(torch, "_int_mm"):
        return False
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-INT8_MAX, INT8_MAX + 1, (32, 512), dtype=torch.int8, generator=generator)
    b = torch.randint(-INT8_MAX, INT8_MAX + 1, (512, 64), dtype=torch.int8, generator=generator)
    a[0], b[:, 0] = INT8_MAX, INT8_MAX  # the largest pair sums there are
    a[1], b[:, 1] = -INT8_MAX, -INT8_MAX
    try:
        return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
    except RuntimeError:
        return False


class RowScaledInt8Weight:
    """An int8 [out, in] weight (per-channel scales, + float bias) for inputs with outliers: x's rows
    are quantized to 8 bits one scale each (`quantize_rows`), multiplied with `torch._int_mm` (int32
    sums), and scaled back by both scales. x: [..., in] -> [..., out] float32."""

    decode_kernel = "rows"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"expected an int8 [out, in] weight and [out] scales, got {q.dtype} "
                             f"{tuple(q.shape)} and {tuple(scale.shape)}")
        self.out_features, self.in_features = q.shape
        self.q, self.scale = q.contiguous(), scale.float()
        self.bias = None if bias is None else bias.detach().float()

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> RowScaledInt8Weight:
        return cls(*quantize_per_channel(weight), bias)

    def int8_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, self.scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        out = torch.empty(flat.shape[0], self.out_features)
        for start in range(0, flat.shape[0], _ROW_CHUNK):
            rows = slice(start, start + _ROW_CHUNK)
            q, row_scale = quantize_rows(flat[rows])
            scaled = torch._int_mm(q, self.q.t()) * row_scale  # int32 sums (the weight seen as [in, out]) -> float
            if self.bias is None:
                torch.mul(scaled, self.scale, out=out[rows])
            else:
                torch.addcmul(self.bias, scaled, self.scale, out=out[rows])
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.in_features * self.out_features + 4 * self.out_features * (1 if self.bias is None else 2)


class Int8Linear(nn.Module):
    """An `nn.Linear` whose weight lives only as int8 with per-channel scales (inference only);
    `rows=True`: activations quantized a row at a time (`RowScaledInt8Weight`)."""

    def __init__(self, linear: nn.Linear, rows: bool = False, **kernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_int8 = RowScaledInt8Weight.quantize(linear.weight, linear.bias) if rows \
            else Int8Weight.quantize(linear.weight, linear.bias, **kernel)
        self.activation: str | None = getattr(linear, "activation", None)  # an ActivatedLinear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight_int8(x)
        return out if self.activation is None else activate_output(self.activation, out)

    def extra_repr(self) -> str:
        w = self.weight_int8
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={w.bias is not None}, "
                f"int8 per-channel, " + ("activations per row" if w.decode_kernel == "rows"
                                         else f"decode={w.decode_kernel}")
                + ("" if self.activation is None else f", activation={self.activation}"))


def is_float_cpu(weight: torch.Tensor) -> bool:
    """Whether `weight` is one `quantize_linears` takes: a float weight on the CPU."""
    return weight.device.type == "cpu" and weight.is_floating_point()


def quantize_linears(model: nn.Module, decode_kernel: str = "fbgemm", keep: Collection[nn.Module] = (),
                     per_row: Collection[nn.Module] = ()) -> int:
    """Replace every CPU float `nn.Linear` but those in `keep` with an Int8Linear (those in `per_row` with
    activations quantized a row at a time); returns how many (the float weights go)."""
    row_weights = [m.weight for m in per_row]
    rows = replace_linears(model, partial(Int8Linear, rows=True),
                           lambda w: is_float_cpu(w) and any(w is r for r in row_weights), keep)
    return rows + replace_linears(model, partial(Int8Linear, decode_kernel=decode_kernel), is_float_cpu, keep)
