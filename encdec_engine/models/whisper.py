"""Whisper (WhisperForConditionalGeneration) over the engine's paged attention.

Encoder: two 1-D convolutions (the second with stride 2, so 3000 mel frames
become 1500 positions) + fixed positional embeddings, then pre-norm layers.
Decoder: token + learned positional embeddings, pre-norm layers with
cross-attention, output projection tied to the token embeddings. As in HF,
queries are scaled before attention (k has no bias), which keeps rounding
identical to `generate`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from encdec_engine.attention.backends.base import AttentionBackend
from encdec_engine.attention.layer import Attention
from encdec_engine.attention.metadata import AttentionMetadata, AttentionType
from encdec_engine.layers.activation import get_activation
from encdec_engine.models.interface import EncoderInputs, KVCacheSpec
from encdec_engine.models.weights import WeightLoader


class WhisperAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, attn_type: AttentionType, backend: AttentionBackend) -> None:
        super().__init__()
        head_dim = d_model // num_heads
        self.scaling = head_dim**-0.5
        self.attn_type = attn_type
        if attn_type == AttentionType.ENCODER_DECODER:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)  # k's share of the bias is zero
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.attn = Attention(num_heads, head_dim, 1.0, attn_type, backend)

    def forward(self, hidden, kv_cache, metadata: AttentionMetadata, encoder_hidden=None) -> torch.Tensor:
        if self.attn_type == AttentionType.ENCODER_DECODER:
            q = self.q_proj(hidden)
            k = v = None
            if encoder_hidden is not None:
                k, v = self.kv_proj(encoder_hidden).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        return self.out_proj(self.attn(q * self.scaling, k, v, kv_cache, metadata))


class WhisperLayer(nn.Module):
    """One pre-norm encoder layer, or (with cross-attention) one decoder layer."""

    def __init__(self, config, backend: AttentionBackend, is_decoder: bool) -> None:
        super().__init__()
        d = config.d_model
        heads = config.decoder_attention_heads if is_decoder else config.encoder_attention_heads
        ffn = config.decoder_ffn_dim if is_decoder else config.encoder_ffn_dim
        self_type = AttentionType.DECODER if is_decoder else AttentionType.ENCODER
        self.self_attn = WhisperAttention(d, heads, self_type, backend)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = WhisperAttention(d, heads, AttentionType.ENCODER_DECODER, backend) if is_decoder else None
        self.encoder_attn_layer_norm = nn.LayerNorm(d) if is_decoder else None
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = get_activation(config.activation_function)

    def forward(self, hidden, kv_cache, metadata, encoder_hidden=None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden), kv_cache, metadata)
        if self.encoder_attn is not None:
            hidden = hidden + self.encoder_attn(self.encoder_attn_layer_norm(hidden), kv_cache, metadata,
                                                encoder_hidden)
        return hidden + self.fc2(self.act(self.fc1(self.final_layer_norm(hidden))))


class WhisperEncoder(nn.Module):
    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(WhisperLayer(config, backend, False) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        # features: [num_requests, n_mels, 2 * max_source_positions] -> [num_requests * 1500, d_model]
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).permute(0, 2, 1)
        hidden = (x + self.embed_positions.weight).reshape(-1, x.shape[-1])
        for layer in self.layers:
            hidden = layer(hidden, None, metadata)
        return self.layer_norm(hidden)


class WhisperDecoder(nn.Module):
    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = nn.Embedding(config.max_target_positions, config.d_model)
        self.layers = nn.ModuleList(WhisperLayer(config, backend, True) for _ in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, input_ids, positions, kv_caches, metadata, encoder_hidden=None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, kv_cache, metadata, encoder_hidden)
        return self.layer_norm(hidden)


class WhisperForConditionalGeneration(nn.Module):
    is_encoder_decoder = True

    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.encoder = WhisperEncoder(config, backend)
        self.decoder = WhisperDecoder(config, backend)

    @property
    def num_mel_bins(self) -> int:
        return self.config.num_mel_bins

    @property
    def max_decoder_len(self) -> int:
        return self.config.max_target_positions

    @property
    def max_encoder_len(self) -> int:
        return self.config.max_source_positions

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        heads = self.config.decoder_attention_heads
        return KVCacheSpec(self.config.decoder_layers, heads, self.config.d_model // heads)

    def encoder_num_positions(self, num_inputs: int) -> int:
        return self.config.max_source_positions  # every window is 30 s: 3000 frames -> 1500 positions

    def default_decoder_prompt(self, generation_config=None) -> list[int]:
        from encdec_engine.models.whisper_tokens import WhisperTokens

        return WhisperTokens.from_configs(self.config, generation_config).decoder_prompt()

    def encode(self, inputs: EncoderInputs, metadata: AttentionMetadata) -> torch.Tensor:
        return self.encoder(inputs.features.to(self.encoder.conv1.weight.dtype), metadata)

    def forward(self, input_ids, positions, kv_caches, metadata, encoder_hidden=None) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, metadata, encoder_hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.decoder.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        loader.alias("proj_out.weight", "decoder.embed_tokens.weight")
        for name, tensor in weights:
            loader.load_attention(name.removeprefix("model."), tensor)
        loader.zero_missing_bias_shards()
        loader.finish()
