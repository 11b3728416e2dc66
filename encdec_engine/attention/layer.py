"""The attention layer every model uses, parameterized by its attention type."""

from __future__ import annotations

import torch
from torch import nn

from encdec_engine.attention.backends.base import AttentionBackend
from encdec_engine.attention.metadata import AttentionMetadata, AttentionType
from encdec_engine.attention.position_bias import PositionBias


class Attention(nn.Module):
    """Scaled dot-product attention over the flat batch, through the engine's backend.

    The layer owns no projections: models project q/k/v themselves and hand
    them here with the layer's KV cache. Cross-attention at decode passes
    `key=value=None` and reads the cross cache written at prefill.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        attn_type: AttentionType,
        backend: AttentionBackend,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.attn_type = attn_type
        self.backend = backend

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        key: torch.Tensor | None,  # [num_kv_tokens, num_kv_heads * head_dim]
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        position_bias: PositionBias | None = None,  # added to the scores per head (T5, ALiBi)
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        view = metadata.view(self.attn_type)
        q = query.view(-1, self.num_heads, self.head_dim)
        k = None if key is None else key.view(-1, self.num_kv_heads, self.head_dim)
        v = None if value is None else value.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, view, self.scale, position_bias)
        return out.reshape(-1, self.num_heads * self.head_dim)
