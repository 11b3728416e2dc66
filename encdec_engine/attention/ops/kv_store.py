"""Triton kernel: scatter new K/V into the paged cache by slot mapping.

Same contract as `attention.backends.base.store_kv` (slot = block * block_size +
offset, values cast to the cache dtype, or quantized into an int8 cache's rows with
their per-group scales as `quantization.kv_int8.quantize_kv` does, bit for bit), plus:
a negative slot skips its token, so padded batches (CUDA graphs) can carry dummy
tokens at slot -1.

One program per token copies all its KV heads, K and V, in one go.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from encdec_engine.quantization.kv_int8 import KV_INT8_MAX, KV_QUANT_GROUP, num_groups, row_width, scale_offset


@triton.jit
def round_half_even(x):
    """torch.round's rounding (ties to even), which the int8 cache must reproduce exactly."""
    r = tl.floor(x + 0.5)
    tie_up_to_odd = ((r - x) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)
    return tl.where(tie_up_to_odd, r - 1.0, r)


@triton.jit
def _store_int8_rows(x, cache_ptr, scale_ptr, dst, scale_dst, h, d, mask,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                     NUM_GROUPS: tl.constexpr, SCALE_OFFSET: tl.constexpr, INT8_MAX: tl.constexpr):
    """Quantize x [HEADS_PAD, HEAD_DIM_PAD] per group of GROUP dims and store values and scales."""
    x = x.to(tl.float32)
    group = d // GROUP  # [HEAD_DIM_PAD]
    x_scale = tl.zeros_like(x)
    for g in tl.static_range(NUM_GROUPS):
        in_group = (group == g)[None, :]
        amax = tl.max(tl.where(in_group, tl.abs(x), 0.0), 1)  # [HEADS_PAD]
        scale = tl.where(amax > 0, amax / INT8_MAX, 1.0)
        tl.store(scale_ptr + scale_dst + SCALE_OFFSET + g, scale, mask=(h < NUM_KV_HEADS) & (scale_dst >= 0))
        x_scale = tl.where(in_group, scale[:, None], x_scale)
    q = tl.minimum(tl.maximum(round_half_even(x / tl.where(x_scale > 0, x_scale, 1.0)), -INT8_MAX), INT8_MAX)
    tl.store(cache_ptr + dst, q.to(tl.int8), mask=mask)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, row_width] each
    k_scale_ptr, v_scale_ptr,  # the same caches seen as float32 (int8 caches only)
    slot_ptr,  # [num_tokens]
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ct, stride_ch, stride_cd,  # cache strides (K and V halves share them)
    stride_sb, stride_st, stride_sh,  # float32-view strides (int8 caches)
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    INT8: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, SCALE_OFFSET: tl.constexpr,
    INT8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    # Broadcast the slot first: the interpreter rejects a scalar term in a block mask.
    slots = tl.full([HEADS_PAD, HEAD_DIM_PAD], 0, tl.int64) + slot
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (slots >= 0)
    # other=0: padding dims must not count in an int8 group's max
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask,
                other=0.0)
    dst = block * stride_cb + offset * stride_ct + h[:, None] * stride_ch + d[None, :] * stride_cd
    if INT8:
        scale_dst = tl.where(tl.full([HEADS_PAD], 0, tl.int64) + slot >= 0,
                             block * stride_sb + offset * stride_st + h * stride_sh, -1)  # [HEADS_PAD]
        _store_int8_rows(k, k_cache_ptr, k_scale_ptr, dst, scale_dst, h, d, mask,
                         NUM_KV_HEADS, HEAD_DIM, GROUP, NUM_GROUPS, SCALE_OFFSET, INT8_MAX)
        _store_int8_rows(v, v_cache_ptr, v_scale_ptr, dst, scale_dst, h, d, mask,
                         NUM_KV_HEADS, HEAD_DIM, GROUP, NUM_GROUPS, SCALE_OFFSET, INT8_MAX)
    else:
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def int8_scale_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """An int8 cache's K and V halves seen as float32 (where their scales are read and written), and
    the float32 strides of a block, a slot and a head."""
    scales = kv_cache.view(torch.float32)  # [2, num_blocks, block_size, num_kv_heads, row_width / 4]
    return scales[0], scales[1], tuple(scales[0].stride()[:3])


def store_kv_triton(
    key: torch.Tensor,  # [num_kv_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_kv_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, row_width]
    slot_mapping: torch.Tensor,  # [num_kv_tokens] int32/int64; -1 = skip this token
) -> None:
    """Write K/V into their cache slots; no host sync, so it can be captured in a CUDA graph."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, width = kv_cache.shape
    head_dim = key.shape[-1]
    int8 = kv_cache.dtype == torch.int8
    if (key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape
            or width != row_width(head_dim, kv_cache.dtype)):
        raise ValueError(f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match "
                         f"{num_tokens} slots of a {kv_cache.dtype} cache with {num_kv_heads} heads x {width}")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if int8:
        k_scale, v_scale, scale_strides = int8_scale_views(kv_cache)
    else:
        # The engine computes K/V in the cache dtype; a mismatch is cast by torch (round to
        # nearest even, exactly like `store_kv`) rather than in-kernel.
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        k_scale, v_scale, scale_strides = k_cache, v_cache, (0, 0, 0)  # unused
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *scale_strides,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, INT8=int8, GROUP=KV_QUANT_GROUP, NUM_GROUPS=num_groups(head_dim),
        SCALE_OFFSET=scale_offset(head_dim) // 4, INT8_MAX=KV_INT8_MAX,
    )
