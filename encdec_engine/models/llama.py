"""Llama (LlamaForCausalLM): a decoder-only model with RoPE and grouped-query attention.

Pre-norm layers with RMSNorm, rotary positions applied to q and k before
they reach the cache, `num_key_value_heads <= num_attention_heads` (the
backend shares each KV head among its group of query heads) and a SiLU-gated
MLP. q/k/v are fused into `qkv_proj` and gate/up into `gate_up_proj`; with
GQA the q rows are a whole number of KV-sized blocks, so the fused weight is
`groups + 2` equal shards and the strict WeightLoader loads q as `groups` of
them::

    qkv_proj rows  | q: groups * kv_size      | k: kv_size | v: kv_size |
                   | shard 0 | ... | g-1      | shard g    | shard g+1  |   kv_size = num_kv_heads * head_dim
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from encdec_engine.attention.backends.base import AttentionBackend
from encdec_engine.attention.layer import Attention
from encdec_engine.attention.metadata import AttentionMetadata, AttentionType
from encdec_engine.layers.activation import get_activation
from encdec_engine.layers.linear import VocabProjection
from encdec_engine.layers.norms import RMSNorm
from encdec_engine.layers.rotary import RotaryEmbedding, apply_rotary, default_inv_freq
from encdec_engine.models.interface import DecoderOnlyModel, KVCacheSpec
from encdec_engine.checkpoints.weights import WeightLoader

# RoPE types whose frequencies are fixed at load; "dynamic" and "longrope" rescale with the length.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3")


def make_rotary(config, head_dim: int) -> RotaryEmbedding:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope_type == "default":
        return RotaryEmbedding(default_inv_freq(theta, head_dim))
    if rope_type in _STATIC_ROPE_TYPES:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        with torch.device("cpu"):  # the model itself is built on the meta device
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return RotaryEmbedding(inv_freq, attention_scaling)
    raise ValueError(f"Llama rope type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}")


class LlamaAttention(nn.Module):
    def __init__(self, config, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads are not a multiple of "
                             f"{self.num_kv_heads} key/value heads")
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, AttentionType.DECODER, backend,
                              num_kv_heads=self.num_kv_heads)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        out = self.attn(q.flatten(1), k.flatten(1), v, kv_cache, metadata)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, inner, bias = config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(d, 2 * inner, bias=bias)
        self.down_proj = nn.Linear(inner, d, bias=bias)
        self.act = get_activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, head_dim, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden, cos, sin, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(DecoderOnlyModel, nn.Module):
    token_embedding = "embed_tokens"

    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.vocab_projection = VocabProjection()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = make_rotary(config, self.head_dim)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.head_dim, backend)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        self.lm_head = None if self.tie_word_embeddings else self.new_head()

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.config.num_hidden_layers, self.layers[0].self_attn.num_kv_heads, self.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # one per layer
        metadata: AttentionMetadata,
        encoder_hidden: torch.Tensor | None = None,  # always None: no encoder
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, hidden.dtype)  # shared by every layer
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, kv_caches[i] if kv_caches else None, metadata)
        return self.norm(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        loader.hold("embed_tokens.weight", "lm_head.weight")
        attn = self.layers[0].self_attn
        groups = attn.num_heads // attn.num_kv_heads
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if ".self_attn.q_proj." in name:
                fused = name.replace(".q_proj.", ".qkv_proj.")
                for g, part in enumerate(tensor.chunk(groups, dim=0)):
                    loader.load_shard(fused, part, g, groups + 2)
            elif ".self_attn.k_proj." in name:
                loader.load_shard(name.replace(".k_proj.", ".qkv_proj."), tensor, groups, groups + 2)
            elif ".self_attn.v_proj." in name:
                loader.load_shard(name.replace(".v_proj.", ".qkv_proj."), tensor, groups + 1, groups + 2)
            elif ".mlp.gate_proj." in name:
                loader.load_shard(name.replace(".gate_proj.", ".gate_up_proj."), tensor, 0, 2)
            elif ".mlp.up_proj." in name:
                loader.load_shard(name.replace(".up_proj.", ".gate_up_proj."), tensor, 1, 2)
            else:
                loader.load(name, tensor)
        self.load_tied_head(loader)
        loader.finish()
