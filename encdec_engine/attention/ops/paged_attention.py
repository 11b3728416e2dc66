"""Triton paged-attention decode: one query token per sequence over its cached context.

    query        [num_seqs, num_heads, head_dim]
    kv_cache     [2, num_blocks, block_size, num_kv_heads, row_width]   (row_width = head_dim,
                                          or an int8 row: values + per-group scales, quantization/kv_int8.py)
    block_tables [num_seqs, max_blocks]   key position p of seq s lives in block
                                          block_tables[s, p // block_size], offset p % block_size
    key_lens     [num_seqs]               keys each sequence attends to (no mask needed)

One program per (sequence, KV head, partition). It loads the query heads that
share that KV head (GQA: num_heads / num_kv_heads of them, padded to 16 rows
so `tl.dot` applies) and runs an online softmax over tiles of TILE_N keys; a
tile may span several pages. Long contexts are split into partitions of
`partition_size` keys (flash-decoding) whose partial results a second kernel
merges, so a few sequences with 1500-position cross caches still fill the GPU.

Whether to partition depends on `max_key_len` alone, never on the batch: a
sequence's partitions are then the same in any batch, partitions past its
keys are empty and weigh exactly 0 in the merge, and a sequence short enough
for one partition gets bit for bit the one-pass result. So a sequence decodes
to the same bits alone, in any batch, and through a CUDA graph padded to the
tables' capacity (batch invariance).

Accumulation is fp32. fp16/bf16 K/V are upcast and multiplied with TF32 dots:
q.k is exact (TF32 holds every fp16/bf16 value) and p.v rounds the
probabilities to TF32, as precise as fp16. fp32 inputs use IEEE dots, so an
fp32 engine keeps fp32 attention (parity with HF). An int8 cache is dequantized
as each tile is loaded (value * its group's float32 scale), then treated as the
query's dtype would be. A position bias (attention/position_bias.py: T5's buckets, ALiBi) is a
[num_heads, num_relative] table the kernel reads per tile at each key's position relative to the
query (the sequence's last key), clamped to the table, and adds to the scaled scores. The grid
depends only on host-side shapes (no `.item()`), so the call can be captured in
a CUDA graph when `max_key_len` is the table's capacity.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from encdec_engine.attention.position_bias import PositionBias
from encdec_engine.quantization.kv_int8 import KV_QUANT_GROUP, row_width, scale_offset
from encdec_engine.attention.ops.kv_store import int8_scale_views

TILE_N = 32  # keys per inner-loop step
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows and a 16-wide reduction dim
_DEFAULT_PARTITION = 512  # keys per partition when partitioning


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim] (unused when SPLIT)
    part_acc_ptr, part_max_ptr, part_sum_ptr,  # [num_seqs, num_heads, P, head_dim_pad], [num_seqs, num_heads, P] x2
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, key_lens_ptr,
    k_scale_ptr, v_scale_ptr,  # int8 caches: the same caches seen as float32 (their scales)
    bias_ptr, stride_bias_h, min_relative, num_relative,  # position bias table [num_heads, num_relative]
    scale,
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_ct, stride_ch, stride_cd,
    stride_sb, stride_st, stride_sh,  # float32-view strides (int8 caches)
    stride_bs, stride_bb,
    stride_os, stride_oh, stride_od,
    NUM_GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    partition_size, num_partitions,  # keys per partition, partitions per sequence (when SPLIT)
    SPLIT: tl.constexpr,  # write partial results for the merge kernel instead of the output
    DOT_PRECISION: tl.constexpr,
    INT8: tl.constexpr, GROUP: tl.constexpr, SCALE_OFFSET: tl.constexpr,  # int8 cache layout
    HAS_BIAS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    key_len = tl.load(key_lens_ptr + seq).to(tl.int32)
    if SPLIT:
        start = part * partition_size
        end = tl.minimum(start + partition_size, key_len)
    else:
        start = 0
        end = key_len

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * NUM_GROUP + g
    g_mask = g < NUM_GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [G, D]

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    head_off = kv_head * stride_ch
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        valid = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bs + (pos // BLOCK_SIZE) * stride_bb, mask=valid, other=0)
        row = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off  # [TILE]
        k_t = tl.load(k_cache_ptr + row[None, :] + d[:, None] * stride_cd,
                      mask=valid[None, :] & d_mask[:, None], other=0.0).to(tl.float32)  # [D, TILE]
        if INT8:
            scale_row = (block.to(tl.int64) * stride_sb + (pos % BLOCK_SIZE) * stride_st
                         + kv_head * stride_sh + SCALE_OFFSET)  # [TILE]
            k_t *= tl.load(k_scale_ptr + scale_row[None, :] + d[:, None] // GROUP,
                           mask=valid[None, :] & d_mask[:, None], other=0.0)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale  # [G, TILE]
        if HAS_BIAS:  # the query is the sequence's last key: relative position pos - (key_len - 1)
            column = tl.minimum(tl.maximum(pos - (key_len - 1) - min_relative, 0), num_relative - 1)
            scores += tl.load(bias_ptr + heads[:, None] * stride_bias_h + column[None, :],
                              mask=g_mask[:, None] & valid[None, :], other=0.0).to(tl.float32)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :] * stride_cd,
                    mask=valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [TILE, D]
        if INT8:
            v *= tl.load(v_scale_ptr + scale_row[:, None] + d[None, :] // GROUP,
                         mask=valid[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m = m_new

    if not SPLIT:
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # an empty context gives zeros, not NaN
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        num_heads = tl.num_programs(1) * NUM_GROUP
        stat = (seq * num_heads + heads) * num_partitions + part  # [G]
        tl.store(part_max_ptr + stat, m, mask=g_mask)
        tl.store(part_sum_ptr + stat, row_sum, mask=g_mask)
        tl.store(part_acc_ptr + stat[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _merge_partitions_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_os, stride_oh, stride_od,
    num_partitions,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PARTITIONS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (seq * tl.num_programs(1) + head) * num_partitions
    p = tl.arange(0, PARTITIONS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    p_mask = p < num_partitions
    m = tl.load(part_max_ptr + base + p, mask=p_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + base + p, mask=p_mask, other=0.0)
    acc = tl.load(part_acc_ptr + (base + p)[:, None] * HEAD_DIM_PAD + d[None, :], mask=p_mask[:, None], other=0.0)
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # every partition empty
    w = tl.exp(m - m_all)  # empty partitions (m = -inf) weigh 0
    total = tl.sum(sums * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def default_partition_size(max_key_len: int) -> int | None:
    """Partition contexts longer than one partition; the batch plays no part (batch invariance)."""
    return None if max_key_len <= _DEFAULT_PARTITION else _DEFAULT_PARTITION


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, row_width]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    key_lens: torch.Tensor,  # [num_seqs] int32/int64
    scale: float,
    block_size: int,
    max_key_len: int | None = None,  # host bound on key_lens; default: the tables' capacity
    partition_size: int | None = -1,  # keys per partition; None: one pass; -1: choose
    position_bias: PositionBias | None = None,  # added to the scaled scores per head and relative position
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], query's dtype
    num_seqs, num_heads, head_dim = query.shape
    _, _, cache_block_size, num_kv_heads, width = kv_cache.shape
    if cache_block_size != block_size or width != row_width(head_dim, kv_cache.dtype):
        raise ValueError(f"cache blocks {cache_block_size} x rows of {width} do not match "
                         f"block_size {block_size} x head_dim {head_dim} in a {kv_cache.dtype} cache")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if max_key_len is None:
        max_key_len = block_tables.shape[1] * block_size
    if partition_size == -1:
        partition_size = default_partition_size(max_key_len)
    if partition_size is not None and partition_size % TILE_N:
        raise ValueError(f"partition_size must be a multiple of {TILE_N}, got {partition_size}")
    num_partitions = 1 if partition_size is None else max(1, triton.cdiv(max_key_len, partition_size))

    group = num_heads // num_kv_heads
    group_pad = max(MIN_DOT_ROWS, triton.next_power_of_2(group))
    head_dim_pad = max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    int8 = kv_cache.dtype == torch.int8
    k_scale, v_scale, scale_strides = int8_scale_views(kv_cache) if int8 else (k_cache, v_cache, (0, 0, 0))
    if num_partitions > 1:
        stats = torch.empty(2, num_seqs, num_heads, num_partitions, dtype=torch.float32, device=query.device)
        part_max, part_sum = stats[0], stats[1]
        part_acc = torch.empty(num_seqs, num_heads, num_partitions, head_dim_pad, dtype=torch.float32,
                               device=query.device)
    else:
        part_max = part_sum = part_acc = out  # unused
    if position_bias is not None:
        table = position_bias.table.to(device=query.device, dtype=torch.float32).contiguous()
        if table.shape[0] != num_heads:
            raise ValueError(f"position bias has {table.shape[0]} heads, the query {num_heads}")
        bias_args = (table, table.stride(0), position_bias.min_relative, table.shape[1])
    else:
        bias_args = (out, 0, 0, 1)  # unused
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, part_acc, part_max, part_sum,
        query, k_cache, v_cache, block_tables, key_lens, k_scale, v_scale,
        *bias_args,
        scale,
        *query.stride(), *k_cache.stride(), *scale_strides, *block_tables.stride(), *out.stride(),
        NUM_GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        partition_size=partition_size or 0, num_partitions=num_partitions,
        BLOCK_SIZE=block_size, TILE=TILE_N, SPLIT=num_partitions > 1,
        DOT_PRECISION="ieee" if (query.dtype if int8 else kv_cache.dtype) == torch.float32 else "tf32",
        INT8=int8, GROUP=KV_QUANT_GROUP, SCALE_OFFSET=scale_offset(head_dim) // 4,
        HAS_BIAS=position_bias is not None,
    )
    if num_partitions > 1:
        _merge_partitions_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum, *out.stride(), num_partitions,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PARTITIONS_PAD=triton.next_power_of_2(num_partitions),
        )
    return out


# True when TRITON_INTERPRET=1 was set at import: the kernels then run on CPU tensors.
INTERPRETED = isinstance(_paged_decode_kernel, InterpretedFunction)
