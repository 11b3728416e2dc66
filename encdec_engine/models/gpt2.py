"""GPT-2 (GPT2LMHeadModel): the decoder-only degenerate case of the engine.

Pre-norm layers, learned absolute positions, fused q/k/v (HF already fuses
them in `c_attn`) and an output projection tied to the token embeddings
(as transformers 5 ties it: models/interface.py's `DecoderOnlyModel`).
There is no encoder and no cross-attention: the metadata of a decoder-only
batch simply has no encoder or cross view.

HF stores GPT-2's projections as `Conv1D` with weights laid out
[in_features, out_features]; `load_weights` transposes them into
`nn.Linear`'s [out, in].
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from encdec_engine.attention.backends.base import AttentionBackend
from encdec_engine.attention.layer import Attention
from encdec_engine.attention.metadata import AttentionMetadata, AttentionType
from encdec_engine.layers.activation import ActivatedLinear
from encdec_engine.layers.linear import VocabProjection
from encdec_engine.models.interface import DecoderOnlyModel, KVCacheSpec
from encdec_engine.checkpoints.weights import WeightLoader

# HF Conv1D weights ([in, out]) that become nn.Linear weights ([out, in]).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Old checkpoints (the hub's openai-community/gpt2) carry causal-mask buffers as weights.
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


def check_config(config) -> None:
    """Reject GPT-2 options this implementation does not reproduce."""
    if getattr(config, "reorder_and_upcast_attn", False):
        raise ValueError("GPT-2 reorder_and_upcast_attn=True (fp32-upcast attention) is not supported; "
                         "it only changes reduced-precision numerics, so set it to False to load this checkpoint")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with add_cross_attention=True needs an encoder; only the decoder-only "
                         "GPT2LMHeadModel is supported")


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        d, heads = config.hidden_size, config.num_attention_heads
        head_dim = d // heads
        if head_dim * heads != d:
            raise ValueError(f"hidden size {d} is not divisible by {heads} heads")
        # HF folds both scalings into one factor handed to attention.
        scale = head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.attn = Attention(heads, head_dim, scale, AttentionType.DECODER, backend)

    def forward(self, hidden: torch.Tensor, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).chunk(3, dim=-1)  # each [num_tokens, d]
        return self.c_proj(self.attn(q, k, v, kv_cache, metadata))


class GPT2MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        inner = config.n_inner or 4 * d
        self.c_fc = ActivatedLinear(d, inner, config.activation_function)
        self.c_proj = nn.Linear(inner, d)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.c_fc(hidden))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.attn = GPT2Attention(config, layer_idx, backend)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden: torch.Tensor, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.attn(self.ln_1(hidden), kv_cache, metadata) + hidden
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2LMHeadModel(DecoderOnlyModel, nn.Module):
    token_embedding = "wte"

    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        check_config(config)
        self.config = config
        self.vocab_projection = VocabProjection()
        d = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, d)
        self.wpe = nn.Embedding(config.max_position_embeddings, d)
        self.h = nn.ModuleList(GPT2Block(config, i, backend) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(d, eps=config.layer_norm_epsilon)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        self.lm_head = None if self.tie_word_embeddings else self.new_head()

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        heads = self.config.num_attention_heads
        return KVCacheSpec(self.config.num_hidden_layers, heads, self.config.hidden_size // heads)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # one per layer
        metadata: AttentionMetadata,
        encoder_hidden: torch.Tensor | None = None,  # always None: no encoder
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.wte(input_ids) + self.wpe(positions)
        for i, block in enumerate(self.h):
            hidden = block(hidden, kv_caches[i] if kv_caches else None, metadata)
        return self.ln_f(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        loader.hold("wte.weight", "lm_head.weight")
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name.endswith(_MASK_BUFFERS):
                continue
            if name.endswith(_CONV1D):
                tensor = tensor.t()
            loader.load(name, tensor)
        self.load_tied_head(loader)
        loader.finish()
