"""The attention and layer shared by the BART family (BART, mBART, Marian, M2M100), Whisper and T5.

One attention class serves encoder self-, decoder self- and cross-attention
(parameterized by its AttentionType), with or without projection biases, any
head size and scaling (T5: none, and a position bias added inside attention);
one layer serves the encoder and (with cross-attention) the decoder of the BART
family and Whisper, post-norm (BART, Marian) or pre-norm (mBART, M2M100, Whisper).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from encdec_engine.attention.backends.base import AttentionBackend
from encdec_engine.attention.layer import Attention
from encdec_engine.attention.metadata import AttentionMetadata, AttentionType
from encdec_engine.attention.position_bias import PositionBias
from encdec_engine.layers.activation import ActivatedLinear
from encdec_engine.models.interface import KVCacheSpec


class EncDecAttention(nn.Module):
    """Fused q/k/v projection (self-attention) or q + fused k/v (cross-attention).

    `prescale_query` scales q before attention instead of inside it (Whisper
    does, and the order of rounding must match HF's to keep parity); where that is
    exact, the scaling is folded into the q projection at load (`fold_query_scaling`).
    """

    def __init__(self, d_model: int, num_heads: int, attn_type: AttentionType, backend: AttentionBackend,
                 prescale_query: bool = False, layer_index: int = 0, head_dim: int | None = None,
                 bias: bool = True, scaling: float | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index  # cross-attention: the decoder layer a capture names
        if head_dim is None:  # the BART family and Whisper: the heads split d_model
            head_dim = d_model // num_heads
            if head_dim * num_heads != d_model:
                raise ValueError(f"d_model {d_model} is not divisible by {num_heads} heads")
        inner = num_heads * head_dim
        self.attn_type = attn_type
        self.scaling = head_dim**-0.5 if scaling is None else scaling
        self.prescale_query = prescale_query
        if attn_type == AttentionType.ENCODER_DECODER:
            self.q_proj = nn.Linear(d_model, inner, bias=bias)
            self.kv_proj = nn.Linear(d_model, 2 * inner, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * inner, bias=bias)
        self.out_proj = nn.Linear(inner, d_model, bias=bias)
        self.query_scaling_folded = False  # see fold_query_scaling
        self.attn = Attention(num_heads, head_dim, 1.0 if prescale_query else self.scaling, attn_type, backend)

    def fold_query_scaling(self) -> bool:
        """Scale the q projection's rows (weight and bias) once instead of q at every call, when that
        gives the same bits: fp32 weights and a power-of-two scaling (head_dim 64: 1/8, every Whisper).
        A power of two scales every product and partial sum of the matmul exactly, so
        x @ (s W).T + s b == (x @ W.T + b) * s bit for bit, and the int8 rows quantize to the same
        values with s times the scale. Call after loading, before the linears are packed or quantized."""
        if not self.prescale_query or self.query_scaling_folded or math.frexp(self.scaling)[0] != 0.5:
            return False
        proj = self.q_proj if self.attn_type == AttentionType.ENCODER_DECODER else self.qkv_proj
        if type(proj) is not nn.Linear or proj.weight.dtype != torch.float32:  # packed or quantized already
            return False
        rows = self.out_proj.in_features  # q's rows of the fused projection
        with torch.no_grad():
            proj.weight[:rows] *= self.scaling
            if proj.bias is not None:
                proj.bias[:rows] *= self.scaling
        self.query_scaling_folded = True
        return True

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, d_model]
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
        encoder_hidden: torch.Tensor | None = None,  # [num_encoder_tokens, d_model], prefill only
        position_bias: PositionBias | None = None,  # T5's relative position bias (self-attention)
    ) -> torch.Tensor:
        if self.attn_type == AttentionType.ENCODER_DECODER:
            q = self.q_proj(hidden)
            k = v = None
            if encoder_hidden is not None:  # decode steps read the cross cache instead
                # (in q's dtype: under int8_bfloat16 the projection is bf16 beside an fp32 decoder)
                k, v = self.kv_proj(encoder_hidden).to(q.dtype).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)  # [num_tokens, num_heads * head_dim] each
        if self.prescale_query and not self.query_scaling_folded:
            q = q * self.scaling
        out = self.attn(q, k, v, kv_cache, metadata, position_bias)
        if metadata.capture is not None and self.attn_type == AttentionType.ENCODER_DECODER:
            metadata.capture.record(self.layer_index, q, kv_cache, self.attn.scale)  # the cross cache is written
        return self.out_proj(out)


class EncDecLayer(nn.Module):
    """One encoder layer, or (with cross-attention) one decoder layer."""

    def __init__(self, config, backend: AttentionBackend, is_decoder: bool, pre_norm: bool,
                 prescale_query: bool = False, layer_index: int = 0) -> None:
        super().__init__()
        d = config.d_model
        heads = config.decoder_attention_heads if is_decoder else config.encoder_attention_heads
        ffn = config.decoder_ffn_dim if is_decoder else config.encoder_ffn_dim
        self_type = AttentionType.DECODER if is_decoder else AttentionType.ENCODER
        self.pre_norm = pre_norm
        self.self_attn = EncDecAttention(d, heads, self_type, backend, prescale_query)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = None
        if is_decoder:
            self.encoder_attn = EncDecAttention(d, heads, AttentionType.ENCODER_DECODER, backend, prescale_query,
                                                layer_index)
            self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = ActivatedLinear(d, ffn, config.activation_function)
        self.fc2 = nn.Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def _residual(self, hidden: torch.Tensor, norm: nn.LayerNorm, block) -> torch.Tensor:
        if self.pre_norm:
            return hidden + block(norm(hidden))
        return norm(hidden + block(hidden))

    def forward(self, hidden, kv_cache, metadata, encoder_hidden=None) -> torch.Tensor:
        hidden = self._residual(hidden, self.self_attn_layer_norm,
                                lambda h: self.self_attn(h, kv_cache, metadata))
        if self.encoder_attn is not None:
            hidden = self._residual(hidden, self.encoder_attn_layer_norm,
                                    lambda h: self.encoder_attn(h, kv_cache, metadata, encoder_hidden))
        return self._residual(hidden, self.final_layer_norm, lambda h: self.fc2(self.fc1(h)))


def decoder_kv_cache_spec(config) -> KVCacheSpec:
    """The paged cache of a BART-style config (BART, Whisper): one per decoder layer, self and cross."""
    heads = config.decoder_attention_heads
    return KVCacheSpec(config.decoder_layers, heads, config.d_model // heads)
