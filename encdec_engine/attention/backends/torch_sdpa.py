"""CPU (and fallback) backend on torch's scaled_dot_product_attention.

Never materializes an O(total_tokens^2) mask: fresh prefill attention runs
per sequence (sequences of equal shape are batched into one call), and
cache reads gather each sequence's context into a batch padded to the
longest context of this step, with a [num_seqs, max_key_len] padding mask.
A position bias (attention/position_bias.py) becomes an additive mask of the
same extent: [heads, q, k] per sequence shape, [num_seqs, heads, max_q, max_key]
per padded batch (made once per step and bias, shared by the layers), or
[heads, key_len] rows added to the scores of an in-place decode read.
Decode reads (one query per sequence) of an fp32 or bf16 pool go straight to the
pool through a compiled kernel where the machine has one (`PagedDecodePlan`,
ops/cpu_decode.py). Otherwise decode reads of a cross context read in place (fp32,
bf16 widened, or an int8 pool's rows dequantized) go through an fp32 head-major copy of it
(`HeadMajorContexts`), kept while decode steps read it; a decode step of several
sequences reads their self contexts from rows it appends to (`SelfRows`; both in
cpu_copies.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from encdec_engine.attention.backends.base import store_kv
from encdec_engine.attention.backends.cpu_copies import (HEAD_MAJOR_BUDGET, HeadMajorContexts, SelfRows,
                                                         SelfRowsPlan, SlabRead)
from encdec_engine.quantization.kv_int8 import as_stored, attend_int8_rows, num_groups, read_rows
from encdec_engine.attention.metadata import AttentionMetadata, AttentionView
from encdec_engine.attention.ops import cpu_decode, onednn_attention
from encdec_engine.attention.ops.cpu_decode import DecodeKernel
from encdec_engine.attention.position_bias import PositionBias

_COPIED = (torch.float32, torch.bfloat16, torch.int8)  # pools whose rows the fp32 copies hold (bf16 widened)
_SLICE_MIN_KEYS = 128  # below this, one padded gather beats a loop over sequences (a lone one reads in place)


@dataclass
class GatherPlan:
    """Padded cache reads of one view, shared by every layer of a step."""

    slots: torch.Tensor  # [num_seqs * max_key_len] cache slot per padded key
    key_mask: torch.Tensor  # [num_seqs, 1, max_query_len, max_key_len] True = attend
    query_positions: torch.Tensor  # [num_seqs, max_query_len] position of each query among its sequence's keys
    bias_masks: dict = field(default_factory=dict)  # id(bias) -> (bias, additive mask): one per bias and step

    def additive_mask(self, bias: PositionBias, dtype: torch.dtype) -> torch.Tensor:
        """[num_seqs, heads, max_query_len, max_key_len]: the bias where key_mask attends, -inf elsewhere."""
        held = self.bias_masks.get(id(bias))
        if held is None:  # the bias is held with its mask: its id stays its own
            held = self.bias_masks[id(bias)] = (bias, bias.padded_mask(self.query_positions, self.key_mask, dtype))
        return held[1]


@dataclass
class FreshPlan:
    """Attention over this step's K/V: the position-bias masks of its sequence shapes, made once per step."""

    bias_blocks: dict = field(default_factory=dict)  # (id(bias), q_len, k_len) -> (bias, [1, H, q, k] mask)

    def bias_block(self, bias: PositionBias, q_len: int, k_len: int, causal: bool, query: torch.Tensor):
        key = (id(bias), q_len, k_len)
        held = self.bias_blocks.get(key)
        if held is None:  # the bias is held with its mask: its id stays its own
            mask = bias.additive_mask(q_len, k_len, causal, query.dtype, query.device)[None]  # [1, H, q, k]
            held = self.bias_blocks[key] = (bias, mask)
        return held[1]


@dataclass
class SlicePlan:
    """Decode reads where every sequence's context is one contiguous run of slots
    (the usual case for cross tables, allocated in one go): zero-copy views."""

    starts: list[int]  # first slot of each sequence's context
    readers: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (first slot, length) -> sequences

    @classmethod
    def of(cls, starts: list[int], key_lens: list[int]) -> SlicePlan:
        """The plan with its readers grouped once, for every layer of the step: sequences that read the same
        context (the beams or best_of samples of one request share its cross cache) are one matmul."""
        readers: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, context in enumerate(zip(starts, key_lens)):
            readers[context].append(i)
        return cls(starts, dict(readers))


@dataclass
class PagedDecodePlan:
    """A decode view read straight from the pool by the compiled kernel (ops/cpu_decode.py): the step's
    block tables and lengths as it takes them, scratch for the scores, and each position bias's mask,
    made once and shared by the layers."""

    tables: torch.Tensor  # [num_seqs, max_blocks] int64
    lens: torch.Tensor  # [num_seqs] int64
    max_len: int
    _scratch: dict = field(default_factory=dict)  # num_heads -> (scores, probabilities) [num_seqs, H, max_len]
    _masks: dict = field(default_factory=dict)  # id(bias) -> (bias, [num_seqs, H, max_len] additive mask)
    _checked: set = field(default_factory=set)  # pool sizes (blocks) the tables and lengths were checked against

    @classmethod
    def of(cls, view: AttentionView) -> PagedDecodePlan | None:
        """The plan if every sequence of the view has exactly one query over the cache, else None."""
        if (view.max_query_len != 1 or view.query_start_loc_list[-1] != view.num_seqs
                or view.block_tables.device.type != "cpu"):
            return None
        return cls(view.block_tables.to(torch.int64).contiguous(), view.key_lens.to(torch.int64).contiguous(),
                   view.max_key_len)

    def check_indices(self, num_blocks: int) -> None:
        """The kernel's bounds check of the tables and lengths against a pool of `num_blocks` blocks, done by
        the first layer that reads such a pool (four reductions, not four at each of the step's layers)."""
        if num_blocks not in self._checked:
            cpu_decode.check_indices(self.tables, self.lens, self.max_len, num_blocks)
            self._checked.add(num_blocks)

    def scratch(self, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._scratch.get(num_heads)
        if held is None:
            shape = (self.lens.shape[0], num_heads, self.max_len)
            held = self._scratch[num_heads] = (torch.empty(shape), torch.empty(shape))
        return held

    def bias_mask(self, bias: PositionBias, dtype: torch.dtype) -> torch.Tensor:
        """[num_seqs, H, max_len]: each sequence's query sits at its last key."""
        held = self._masks.get(id(bias))
        if held is None:  # the bias is held with its mask: its id stays its own
            key_mask = (torch.arange(self.max_len) < self.lens[:, None])[:, None, None, :]
            mask = bias.padded_mask((self.lens - 1)[:, None], key_mask, dtype)[:, :, 0]
            held = self._masks[id(bias)] = (bias, mask)
        return held[1]


def plan_gather(view: AttentionView, block_size: int) -> GatherPlan:
    assert view.block_tables is not None
    max_key = view.max_key_len
    device = view.block_tables.device
    pos = torch.arange(max_key, device=device)  # [max_key_len]
    blocks = view.block_tables.index_select(1, pos // block_size)  # [num_seqs, max_key_len]
    valid = pos[None, :] < view.key_lens[:, None]  # [num_seqs, max_key_len]
    slots = torch.where(valid, blocks * block_size + pos % block_size, 0)
    mask = valid[:, None, None, :]
    # Bottom-right aligned: query j of a sequence with q queries and k keys is at position k - q + j
    # (and, causal, sees keys up to it).
    q_lens = view.query_start_loc[1:] - view.query_start_loc[:-1]
    j = torch.arange(view.max_query_len, device=device)
    query_positions = view.key_lens[:, None] - q_lens[:, None] + j[None, :]  # [num_seqs, max_query_len]
    if view.causal and view.max_query_len > 1:
        mask = mask & (pos[None, None, :] <= query_positions[:, :, None])[:, None]
    return GatherPlan(slots.reshape(-1), mask, query_positions)


def plan_slices(view: AttentionView, block_size: int) -> SlicePlan | None:
    """A SlicePlan if every context is contiguous in the pool, else None."""
    if view.max_query_len != 1 or view.block_tables.device.type != "cpu":
        return None
    tables = view.block_tables.numpy()
    starts = []
    for i, key_len in enumerate(view.key_lens_list):
        used = tables[i, : -(-key_len // block_size)]
        if len(used) > 1 and not (used[1:] - used[:-1] == 1).all():
            return None
        starts.append(int(used[0]) * block_size)
    return SlicePlan.of(starts, view.key_lens_list)


class TorchSDPABackend:
    name = "torch-sdpa"
    supports_cuda_graphs = False  # decode slices and gathers by host-side key lengths

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.head_major = HeadMajorContexts(block_size)
        self.self_rows = SelfRows(block_size)
        # Long bidirectional prefill attention through oneDNN matmuls in this dtype (ops/onednn_attention.py);
        # None: off. The loader turns it on where the machine's fp32 linears run on oneDNN.
        self.onednn_attention: torch.dtype | None = None
        # With bf16 there on a CPU with AMX: torch's flash kernel in bf16 instead (onednn_attention.amx_flash).
        self.amx_flash = False
        # Decode reads of an fp32 or bf16 pool through the compiled kernel (ops/cpu_decode.py); None: through
        # the copies. The loader sets it for such pools on the CPU where the kernel builds.
        self.fused_decode: DecodeKernel | None = None

    def blocks_written(self, blocks: list[int]) -> None:
        """The cache engine moved or copied K/V into these blocks."""
        self.head_major.blocks_written(blocks)
        self.self_rows.blocks_written(blocks)

    def size_copies(self, pool_fp32_bytes: int) -> None:
        """Let the head-major copies take up to what the KV pool would take in fp32 (at least
        HEAD_MAJOR_BUDGET): room for every cross context the pool can hold. A context without room is
        read from the pool on its own (two matmuls a layer): with half this budget, T5-base's 256
        requests read a third of their contexts that way, 9% of the run's time."""
        self.head_major.budget = self.self_rows.budget = max(HEAD_MAJOR_BUDGET, pool_fp32_bytes)

    def release(self) -> None:
        """The engine is idle: drop the head-major copies and the self rows."""
        self.head_major.keep(set())
        self.self_rows.clear()

    def plan(self, metadata: AttentionMetadata) -> None:
        for view in (metadata.encoder, metadata.decoder, metadata.cross):
            if view is not None and not view.reads_cache:
                view.plan = FreshPlan()
        for view in (metadata.decoder, metadata.cross):
            if view is not None:
                self.head_major.slots_written(view.slot_mapping)
            if view is not None and view.reads_cache:
                if self.fused_decode is not None:
                    view.plan = PagedDecodePlan.of(view)
                    if view.plan is not None:
                        continue
                if (view.seq_ids is not None and view.causal and view.max_query_len == 1 and view.num_seqs > 1
                        and view.block_tables.device.type == "cpu"):
                    view.plan = self.self_rows.plan(view)  # several sequences decoding: their self rows
                    if view.plan is not None:
                        continue
                # Long contexts (or a lone sequence's) read in place when contiguous; short ones gather
                # into one batch.
                in_place = view.max_key_len >= _SLICE_MIN_KEYS or view.num_seqs == 1
                slices = plan_slices(view, self.block_size) if in_place else None
                view.plan = slices or plan_gather(view, self.block_size)
        decode_reads = [v for v in (metadata.decoder, metadata.cross)
                         if v is not None and v.reads_cache and not v.causal and v.max_query_len == 1]
        if decode_reads:  # a decode step: the copies of contexts it does not read go
            self.head_major.keep({context for v in decode_reads if isinstance(v.plan, SlicePlan)
                                  for context in zip(v.plan.starts, v.key_lens_list)})

    def forward(self, query, key, value, kv_cache, view: AttentionView, scale: float,
                position_bias: PositionBias | None = None) -> torch.Tensor:
        if key is not None and view.slot_mapping is not None and kv_cache is not None:
            store_kv(key, value, kv_cache, view.slot_mapping)
            if not view.reads_cache:  # attend to the K/V as the cache holds them (int8 or a narrower float: rounded)
                key, value = as_stored(key, kv_cache.dtype), as_stored(value, kv_cache.dtype)
        if view.reads_cache and query.dtype == torch.bfloat16 and query.device.type == "cpu":
            # A bf16 model on the CPU reads its bf16 cache in fp32: the compiled decode kernel widens each
            # value as it reads it, the self rows and the head-major copies hold fp32, and the other reads
            # widen the rows they gather (`read_rows`), where torch's bf16 math attention upcasts every
            # read (5x slower).
            # Fresh K/V (prefill) are attended in bf16: oneDNN's native bf16 matmuls or SDPA's flash kernel.
            if key is not None and isinstance(view.plan, SelfRowsPlan):  # the only reader of this step's K/V
                key, value = key.float(), value.float()
            return self._read_cache(query.float(), key, value, kv_cache, view, scale, position_bias).to(query.dtype)
        return self._read_cache(query, key, value, kv_cache, view, scale, position_bias) if view.reads_cache \
            else self._attend_fresh(query, key, value, view, scale, position_bias)

    def _read_cache(self, query, key, value, kv_cache, view: AttentionView, scale: float,
                    position_bias: PositionBias | None) -> torch.Tensor:
        if isinstance(view.plan, PagedDecodePlan):
            return self._attend_paged(query, kv_cache, view.plan, scale, position_bias)
        if isinstance(view.plan, SelfRowsPlan) and query.dtype == torch.float32 and kv_cache.dtype in _COPIED:
            return self._attend_self_rows(query, key, value, kv_cache, view, scale, position_bias)
        return self._attend_cache(query, kv_cache, view, scale, position_bias)

    def _attend_paged(self, query, kv_cache, plan: PagedDecodePlan, scale: float | None,
                      position_bias: PositionBias | None) -> torch.Tensor:
        """One query per sequence over its cached keys, read from the pool by the compiled kernel."""
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        q = query if scale == 1.0 else query * scale
        mask = None if position_bias is None else plan.bias_mask(position_bias, q.dtype)
        plan.check_indices(kv_cache.shape[1])
        return self.fused_decode.attend(q, kv_cache, plan.tables, plan.lens, plan.max_len, mask,
                                        plan.scratch(q.shape[1]), indices_checked=True)

    def _attend_self_rows(self, query, key, value, kv_cache, view: AttentionView, scale: float,
                          position_bias: PositionBias | None) -> torch.Tensor:
        """Decode self-attention over the sequences' rows (`SelfRows`): padded matmuls over runs of rows
        (`row_segments`; one run when the contexts are alike)."""
        plan: SelfRowsPlan = view.plan
        head_dim, num_heads = query.shape[-1], query.shape[1]
        keys, values = self.self_rows.layer(kv_cache, head_dim, plan, view, key, value)
        num_kv_heads = keys.shape[1]
        group = num_heads // num_kv_heads
        q = torch.zeros(plan.high, num_kv_heads, group, head_dim)
        q.view(plan.high, num_heads, head_dim).index_copy_(0, plan.rows, query if scale == 1.0 else query * scale)
        mask = plan.additive_mask(position_bias, q.dtype)[:, :, 0]  # [high, 1 or H, L]
        mask = mask.unflatten(1, (num_kv_heads, group)) if mask.shape[1] > 1 else mask[:, :, None]
        o = torch.empty_like(q)  # [high, Hkv, G, D]
        for first, after, length in plan.segments:
            scores = torch.matmul(q[first:after], keys[first:after, :, :, :length])  # [n, Hkv, G, length]
            scores += mask[first:after, :, :, :length]
            torch.matmul(torch.softmax(scores, dim=-1), values[first:after, :, :length], out=o[first:after])
        return o.view(plan.high, num_heads, head_dim).index_select(0, plan.rows)

    def _attend_fresh(self, query, key, value, view: AttentionView, scale: float,
                      position_bias: PositionBias | None = None) -> torch.Tensor:
        """Block-diagonal attention over this step's K/V, one SDPA call per sequence shape (with a
        position bias, one [heads, q, k] mask per shape: its sequences share their relative positions)."""
        q_loc, k_loc, k_lens = view.query_start_loc_list, view.key_start_loc_list, view.key_lens_list
        out = torch.empty_like(query)
        by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i in range(len(k_lens)):
            by_shape[(q_loc[i + 1] - q_loc[i], k_lens[i])].append(i)
        gqa = query.shape[1] != key.shape[1]
        for (q_len, k_len), seqs in by_shape.items():
            if q_len == 0:
                continue
            mask = None
            if position_bias is not None:
                fresh = view.plan if isinstance(view.plan, FreshPlan) else FreshPlan()
                mask = fresh.bias_block(position_bias, q_len, k_len, view.causal, query)
            causal = view.causal and mask is None
            if (self.onednn_attention is not None and mask is None and not view.causal
                    and onednn_attention.applies(query, q_len, k_len)):
                for i in seqs:
                    args = (query[q_loc[i] : q_loc[i + 1]], key[k_loc[i] : k_loc[i] + k_len],
                            value[k_loc[i] : k_loc[i] + k_len], query.shape[-1] ** -0.5 if scale is None else scale,
                            out[q_loc[i] : q_loc[i + 1]])
                    if self.amx_flash:
                        onednn_attention.amx_flash(*args)
                    else:
                        onednn_attention.attend(*args, self.onednn_attention)
                continue
            if len(seqs) == 1:
                i = seqs[0]
                q = query[q_loc[i] : q_loc[i + 1]].transpose(0, 1)[None]  # [1, H, q, D]
                k = key[k_loc[i] : k_loc[i] + k_len].transpose(0, 1)[None]  # [1, Hkv, k, D]
                v = value[k_loc[i] : k_loc[i] + k_len].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                   enable_gqa=gqa)
                out[q_loc[i] : q_loc[i + 1]] = o[0].transpose(0, 1)
                continue
            n = len(seqs)
            if (len(by_shape) == 1 and query.shape[0] == n * q_len and key.shape[0] == n * k_len
                    and _uniform(q_loc, q_len) and _uniform(k_loc, k_len)):
                # Back-to-back equal segments (e.g. Whisper windows): plain reshapes, no gathers.
                q = query.view(n, q_len, *query.shape[1:]).transpose(1, 2)  # [n, H, q, D]
                k = key.view(n, k_len, *key.shape[1:]).transpose(1, 2)
                v = value.view(n, k_len, *value.shape[1:]).transpose(1, 2)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                   enable_gqa=gqa)
                return o.transpose(1, 2).reshape(query.shape)
            q_idx = _segments(q_loc, seqs, q_len, query.device)  # [n, q]
            k_idx = _segments(k_loc, seqs, k_len, query.device)  # [n, k]
            q = query[q_idx].transpose(1, 2)  # [n, H, q, D]
            k = key[k_idx].transpose(1, 2)
            v = value[k_idx].transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
            out[q_idx.reshape(-1)] = o.transpose(1, 2).reshape(-1, *query.shape[1:])
        return out

    def _attend_cache(self, query, kv_cache, view: AttentionView, scale: float,
                      position_bias: PositionBias | None = None) -> torch.Tensor:
        """Paged attention: read each sequence's cached context in place or gathered, padded per batch."""
        if isinstance(view.plan, SlicePlan):
            return self._attend_slices(query, kv_cache, view, view.plan, scale, position_bias)
        plan = view.plan if isinstance(view.plan, GatherPlan) else plan_gather(view, self.block_size)
        key_mask = plan.key_mask if position_bias is None else plan.additive_mask(position_bias, query.dtype)
        _, _, _, num_kv_heads, width = kv_cache.shape
        num_seqs, max_key, head_dim = view.num_seqs, view.max_key_len, query.shape[-1]
        k = read_rows(kv_cache[0].view(-1, num_kv_heads, width).index_select(0, plan.slots), head_dim, query.dtype)
        v = read_rows(kv_cache[1].view(-1, num_kv_heads, width).index_select(0, plan.slots), head_dim, query.dtype)
        k = k.view(num_seqs, max_key, num_kv_heads, head_dim).transpose(1, 2)  # [n, Hkv, L, D]
        v = v.view(num_seqs, max_key, num_kv_heads, head_dim).transpose(1, 2)
        gqa = query.shape[1] != num_kv_heads
        # k, v and an additive mask are in the query's dtype (read_rows widens or dequantizes to it)
        if view.max_query_len == 1:
            o = F.scaled_dot_product_attention(query[:, :, None, :], k, v, attn_mask=key_mask, scale=scale,
                                               enable_gqa=gqa)  # [n, H, 1, D]
            return o[:, :, 0, :]
        out = torch.empty_like(query)
        q_loc = view.query_start_loc_list
        for i in range(num_seqs):
            q_len = q_loc[i + 1] - q_loc[i]
            if q_len == 0:
                continue
            q = query[q_loc[i] : q_loc[i + 1]].transpose(0, 1)[None]  # [1, H, q, D]
            o = F.scaled_dot_product_attention(q, k[i : i + 1], v[i : i + 1], attn_mask=key_mask[i : i + 1, :, :q_len],
                                               scale=scale, enable_gqa=gqa)
            out[q_loc[i] : q_loc[i + 1]] = o[0].transpose(0, 1)
        return out


    def _attend_slices(self, query, kv_cache, view: AttentionView, plan: SlicePlan, scale: float,
                       position_bias: PositionBias | None = None) -> torch.Tensor:
        """One query per sequence against its contiguous run of slots. In fp32, two batched matmuls over
        the kv heads: SDPA would copy the strided [L, H, D] -> [H, L, D] views first (4x slower for a
        1,500-key cross read). Sequences that read the same context (the beams or best_of samples of
        one request share its cross cache) are one matmul over their stacked queries, so the context
        is read once, not once per sequence. Half precision keeps SDPA, which accumulates the softmax
        in fp32. An int8 cache with one scale per row is read with its scales applied to the scores
        and probabilities (`attend_int8_rows`); other int8 rows are dequantized one context at a time.
        A cross context (fp32 or int8 pool, fp32 queries) is read from its head-major copy while the
        budget allows, in one padded batch with the others of its slab (`HeadMajorContexts`). A position
        bias is added to each context's scores ([heads, key_len]: its readers' one query each sits at its
        last key)."""
        _, _, _, num_kv_heads, width = kv_cache.shape
        head_dim = query.shape[-1]
        keys = kv_cache[0].view(-1, num_kv_heads, width)
        values = kv_cache[1].view(-1, num_kv_heads, width)
        group = query.shape[1] // num_kv_heads  # query heads per kv head
        out = torch.empty_like(query)
        fold_scales = (kv_cache.dtype == torch.int8 and query.dtype == torch.float32 and num_groups(head_dim) == 1
                       and position_bias is None)
        head_major = (not view.causal and query.dtype == torch.float32 and position_bias is None
                      and kv_cache.dtype in _COPIED)
        scaled = query if scale == 1.0 else query * scale  # the matmul paths' queries (1.0: the model scaled them)
        readers = plan.readers
        if head_major:
            slab_reads, readers = self.head_major.reads(kv_cache, readers, head_dim, query.device)
            for read in slab_reads:
                self._read_slab(scaled, read, out, num_kv_heads, group, head_dim)
        for (start, key_len), rows in readers.items():
            bias = None if position_bias is None else position_bias.block(1, key_len, query.device)  # [H, 1, L]
            if fold_scales:
                for i in rows:
                    out[i] = attend_int8_rows(query[i], keys[start : start + key_len],
                                              values[start : start + key_len], scale)
                continue
            k = read_rows(keys[start : start + key_len], head_dim, query.dtype)  # [L, Hkv, D], the query's dtype
            v = read_rows(values[start : start + key_len], head_dim, query.dtype)
            if k.dtype != torch.float32:
                k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]
                mask = None if bias is None else bias.to(k.dtype)
                for i in rows:
                    o = F.scaled_dot_product_attention(query[i, :, None, :], k, v, attn_mask=mask, scale=scale,
                                                       enable_gqa=group > 1)  # [H, 1, D]
                    out[i] = o[:, 0]
                continue
            keys_t, v = k.permute(1, 2, 0), v.transpose(0, 1)  # [Hkv, D, L], [Hkv, L, D]
            n = len(rows)
            if n == 1:  # [Hkv, G, D]: the kv heads' queries, a view
                q = scaled[rows[0]].view(num_kv_heads, group, head_dim)
            else:  # [Hkv, n * G, D]: each kv head's queries from every reader, reader-major
                q = scaled[rows].view(n, num_kv_heads, group, head_dim).transpose(0, 1)
                q = q.reshape(num_kv_heads, n * group, head_dim)
            scores = torch.bmm(q, keys_t)  # [Hkv, n * G, L]
            if bias is not None:  # per query head: [Hkv, G, L], the same for each reader
                bias = bias.view(num_kv_heads, 1, group, key_len).expand(num_kv_heads, n, group, key_len)
                scores += bias.reshape(num_kv_heads, n * group, key_len)
            probs = torch.softmax(scores, dim=-1)  # [Hkv, n*G, L]
            if n == 1:  # straight into the output row
                torch.bmm(probs, v, out=out[rows[0]].view(num_kv_heads, group, head_dim))
                continue
            o = torch.bmm(probs, v)  # [Hkv, n * G, D]
            out[rows] = o.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, -1, head_dim)
        return out

    @staticmethod
    def _read_slab(scaled, read: SlabRead, out, num_kv_heads: int, group: int, head_dim: int) -> None:
        """Attend the readers of a slab's contexts, into their rows of `out`."""
        count, n = read.keys.shape[0], read.readers
        # [count, Hkv, D, n * G]: each context's readers' queries, head by head, as columns
        q = scaled.index_select(0, read.rows).view(count, n, num_kv_heads, group, head_dim)
        q = q.permute(0, 2, 4, 1, 3).reshape(count, num_kv_heads, head_dim, n * group)
        scores = torch.matmul(read.keys, q).transpose(-1, -2) + read.mask  # [count, Hkv, n * G, Lc]
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(read.values, probs.transpose(-1, -2))  # [count, Hkv, D, n * G]
        o = o.view(count, num_kv_heads, head_dim, n, group).permute(0, 3, 1, 4, 2).reshape(count * n, -1, head_dim)
        out.index_copy_(0, read.rows, o)


def _uniform(starts: list[int], length: int) -> bool:
    """Segments i start at i * length: the flat batch is exactly [n, length]."""
    return all(start == i * length for i, start in enumerate(starts))


def _segments(starts: list[int], seqs: list[int], length: int, device: torch.device) -> torch.Tensor:
    """Token indices [len(seqs), length] of equal-length segments of a flat batch."""
    base = torch.tensor([starts[i] for i in seqs], device=device)
    return base[:, None] + torch.arange(length, device=device)[None, :]
