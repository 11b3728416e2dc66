"""The int8 KV cache (`kv_cache_dtype="int8"`): per-group scales stored inside each cache row.

Every (token, head) row of K or V keeps its `head_dim` values as int8 with one float32 scale
per group of `KV_QUANT_GROUP` consecutive values (the `quant_bit=8`, `quant_group` scheme of
the fused cache-attention op in the project's seeds), symmetric:

    scale[g] = max |x[g * G : (g + 1) * G]| / 127        q = round(x / scale[g])   (-127..127)

The scales live in the same int8 tensor, after the values, so a block's bytes are its whole
content: copy-on-write, swapping and prefix caching move them with the block unchanged.

    one row (bytes)  | q[0] ... q[D-1] | pad to 4 | scale[0] ... scale[G'-1] (float32) |
                     |<--- D --->|            |<------------- 4 * G' -------------->|
                     G' = ceil(D / G); the last group may be partial

    kv_cache[layer]: [2, num_blocks + 1, block_size, num_kv_heads, row_bytes]  int8

For tiny.en (head_dim 64, G = 64) a row is 68 bytes against 256 in float32: 3.76x the tokens
in the same memory. Quantization happens where K/V are stored (`store_kv`, the Triton store
kernel); attention dequantizes the context it reads. A prefill that stores K/V also attends to
them as stored (`as_stored`), not to the fresh values: a sequence then sees the same keys whether
they come from this step or from the cache (a prefix hit, an encoder output reused, the batch
beside it), so caching and batching leave its tokens unchanged, as with a float cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Head-dim values that share one scale: a whole head of 64 (Whisper, BART): one scale per row,
# which decode folds into the scores instead of multiplying it out (attend_int8_rows).
KV_QUANT_GROUP = 64
KV_INT8_MAX = 127
_SCALE_BYTES = 4  # float32


def num_groups(head_dim: int) -> int:
    return -(-head_dim // KV_QUANT_GROUP)


def scale_offset(head_dim: int) -> int:
    """Byte offset of the first scale in a row (the values padded to a float32 boundary)."""
    return -(-head_dim // _SCALE_BYTES) * _SCALE_BYTES


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Last dimension of a cache of `dtype` for heads of `head_dim` values."""
    if dtype != torch.int8:
        return head_dim
    return scale_offset(head_dim) + _SCALE_BYTES * num_groups(head_dim)


def tokens_ratio(head_dim: int, dtype: torch.dtype, reference: torch.dtype = torch.float32) -> float:
    """How many more tokens a pool of `dtype` holds than one of `reference`, byte for byte."""
    size = lambda d: row_width(head_dim, d) * torch.empty((), dtype=d).element_size()  # noqa: E731
    return size(reference) / size(dtype)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """x: [..., head_dim] float -> packed int8 rows [..., row_width(head_dim, int8)]."""
    head_dim = x.shape[-1]
    groups = num_groups(head_dim)
    xf = F.pad(x.float(), (0, groups * KV_QUANT_GROUP - head_dim)).unflatten(-1, (groups, KV_QUANT_GROUP))
    amax = xf.abs().amax(dim=-1)  # [..., groups]
    scale = torch.where(amax > 0, amax / KV_INT8_MAX, torch.ones_like(amax))  # an all-zero group stays 0
    q = torch.round(xf / scale[..., None]).clamp_(-KV_INT8_MAX, KV_INT8_MAX).to(torch.int8).flatten(-2)
    pad = scale_offset(head_dim) - head_dim
    parts = [q[..., :head_dim]]
    if pad:
        parts.append(q.new_zeros(*q.shape[:-1], pad))
    parts.append(scale.contiguous().view(torch.int8))  # [..., 4 * groups]: the float32 bytes
    return torch.cat(parts, dim=-1)


def dequantize_kv(rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed int8 rows [..., row_width] -> [..., head_dim] of `dtype` (contiguous)."""
    offset, groups = scale_offset(head_dim), num_groups(head_dim)
    scale = rows[..., offset : offset + _SCALE_BYTES * groups]
    if scale.stride(-1) != 1 or any(s % _SCALE_BYTES for s in scale.stride()[:-1]):
        scale = scale.contiguous()
    scale = scale.view(torch.float32)  # [..., groups]
    # A fresh contiguous copy scaled in place: an out-of-place product would take its layout
    # from the strided scales, and a later matmul over it would crawl.
    out = rows[..., :head_dim].to(torch.float32, memory_format=torch.contiguous_format)
    if head_dim == groups * KV_QUANT_GROUP:
        out.unflatten(-1, (groups, KV_QUANT_GROUP)).mul_(scale.unsqueeze(-1))
    else:  # a partial last group
        out.mul_(scale.repeat_interleave(KV_QUANT_GROUP, dim=-1)[..., :head_dim])
    return out.to(dtype)


def read_rows(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row_width] as values [..., head_dim] of `dtype` (dequantized if int8, widened
    from a bf16 pool to fp32)."""
    if rows.dtype == torch.int8:
        return dequantize_kv(rows, head_dim, dtype)
    return rows.to(dtype)


def attend_int8_rows(
    query: torch.Tensor,  # [num_heads, head_dim] float32, one token
    keys: torch.Tensor,  # [L, num_kv_heads, row_width] int8 rows with one scale each
    values: torch.Tensor,  # [L, num_kv_heads, row_width]
    scale: float,
) -> torch.Tensor:  # [num_heads, head_dim]
    """softmax(q k^T * scale) v over int8 rows whose head has one group: a row's scale multiplies its
    score (K) and its probability (V), so the int8 values are only converted, never scaled out:
    two conversions and two batched matmuls over the kv heads, plus [heads, L] products."""
    num_heads, head_dim = query.shape
    length, num_kv_heads, _ = keys.shape
    offset, group = scale_offset(head_dim), num_heads // num_kv_heads
    k_scale = keys[..., offset : offset + _SCALE_BYTES].view(torch.float32)[..., 0].t()  # [Hkv, L]
    v_scale = values[..., offset : offset + _SCALE_BYTES].view(torch.float32)[..., 0].t()
    k = keys[..., :head_dim].to(torch.float32, memory_format=torch.contiguous_format)  # [L, Hkv, D]
    q = query.view(num_kv_heads, group, head_dim) * scale
    scores = torch.bmm(q, k.permute(1, 2, 0)) * k_scale[:, None, :]  # [Hkv, G, L]
    probs = torch.softmax(scores, dim=-1) * v_scale[:, None, :]
    v = values[..., :head_dim].to(torch.float32, memory_format=torch.contiguous_format)
    return torch.bmm(probs, v.transpose(0, 1)).view(num_heads, head_dim)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Values [..., head_dim] as a cache of `cache_dtype` gives them back, in x's dtype: rounded to int8
    and its scales, or to a narrower float (fp32 values in a bf16 pool: compute type int8_bfloat16)."""
    if cache_dtype == torch.int8:
        return dequantize_kv(quantize_kv(x), x.shape[-1], x.dtype)
    if torch.finfo(cache_dtype).bits >= torch.finfo(x.dtype).bits:  # the pool holds x exactly
        return x
    return x.to(cache_dtype).to(x.dtype)


def write_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Values [..., head_dim] as rows of a cache of `cache_dtype` (quantized if int8)."""
    return quantize_kv(x) if cache_dtype == torch.int8 else x.to(cache_dtype)
