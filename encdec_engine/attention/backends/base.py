"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from encdec_engine.quantization.kv_int8 import write_rows
from encdec_engine.attention.metadata import AttentionMetadata, AttentionView
from encdec_engine.attention.position_bias import PositionBias


class AttentionBackend(Protocol):
    name: str
    # Decode takes no host-side decision from the batch (no per-sequence loops, no syncs), so a
    # decode forward over fixed-size buffers can be captured in a CUDA graph.
    supports_cuda_graphs: bool

    def plan(self, metadata: AttentionMetadata) -> None:
        """Precompute, once per step, whatever every layer would otherwise redo."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor | None,  # [num_kv_tokens, num_kv_heads, head_dim]; None: read the cache only
        value: torch.Tensor | None,  # [num_kv_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, num_kv_heads, row_width (head_dim unless int8)]
        view: AttentionView,
        scale: float,
        position_bias: PositionBias | None = None,  # [heads] x relative position, added to the scores
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store new K/V at `view.slot_mapping` (if any), then attend as the view says: softmax(q k^T
        * scale + bias) v, the bias taken at each key's position relative to its query's."""
        ...


def store_kv(
    key: torch.Tensor,  # [num_kv_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_kv_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, row_width]
    slot_mapping: torch.Tensor,  # [num_kv_tokens] int64
) -> None:
    """Write K/V into their cache slots (slot = block * block_size + offset), quantized for an
    int8 cache (row_width then holds the values and their scales, quantization/kv_int8.py)."""
    _, _, _, num_kv_heads, width = kv_cache.shape
    kv_cache[0].view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, write_rows(key, kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, write_rows(value, kv_cache.dtype))
