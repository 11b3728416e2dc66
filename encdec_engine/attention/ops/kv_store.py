"""Triton kernel: scatter new K/V into the paged cache by slot mapping.

Same contract as `attention.backends.base.store_kv` (slot = block * block_size +
offset, values cast to the cache dtype), plus: a negative slot skips its token,
so padded batches (CUDA graphs) can carry dummy tokens at slot -1.

One program per token copies all its KV heads, K and V, in one go.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] each
    slot_ptr,  # [num_tokens]
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ct, stride_ch, stride_cd,  # cache strides (K and V halves share them)
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
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
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    dst = block * stride_cb + offset * stride_ct + h[:, None] * stride_ch + d[None, :] * stride_cd
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_triton(
    key: torch.Tensor,  # [num_kv_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_kv_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_kv_tokens] int32/int64; -1 = skip this token
) -> None:
    """Write K/V into their cache slots; no host sync, so it can be captured in a CUDA graph."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match "
                         f"{num_tokens} slots of a cache with {num_kv_heads} heads x {head_dim}")
    # The engine computes K/V in the cache dtype; a mismatch is cast by torch (round to
    # nearest even, exactly like `store_kv`) rather than in-kernel.
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )
