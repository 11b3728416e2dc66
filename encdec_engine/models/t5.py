"""T5 and mT5 (T5ForConditionalGeneration, MT5ForConditionalGeneration) over the engine's paged attention.

Pre-norm layers with T5's RMS layer norm (no bias, no mean), attention without projection biases and
without scaling, heads of `d_kv` values (not d_model / heads), a ReLU (t5 v1.0) or gated-GELU (v1.1,
Flan, mT5) feed-forward. Positions enter only as a relative position bias: each stack's first layer
owns an embedding of buckets x heads, bidirectional in the encoder and causal in the decoder, built
once per stack and step (attention/position_bias.py) and added inside every self-attention of the
stack, prefill and paged decode alike; cross-attention has none (as in HF).

Embeddings as transformers 5 ties them: its config forces `tie_word_embeddings`, so the encoder's and
decoder's token embeddings and the head are `shared`, each untied where the checkpoint holds its own
with other values (the head of v1.1, Flan, mT5). A saved `tie_word_embeddings: false` only means no
scaling: t5 scales the decoder output by d_model**-0.5 before the head when `scale_decoder_outputs`
(what transformers 5 makes of `tie_word_embeddings`), mT5 never. `tie_encoder_decoder` ties nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from encdec_engine.attention.backends.base import AttentionBackend
from encdec_engine.attention.metadata import AttentionMetadata, AttentionType
from encdec_engine.attention.position_bias import PositionBias, t5_bucket_index, t5_position_bias
from encdec_engine.checkpoints.generation_config import decoder_start_token_id
from encdec_engine.checkpoints.weights import (DECODER_EMBEDDING, ENCODER_EMBEDDING, LM_HEAD, SHARED,
                                              WeightLoader, resolve_ties, tied)
from encdec_engine.layers.activation import ActivatedLinear, get_activation
from encdec_engine.layers.linear import VocabProjection
from encdec_engine.layers.norms import RMSNorm
from encdec_engine.models.encdec_layers import EncDecAttention
from encdec_engine.models.interface import EncoderInputs, KVCacheSpec

_DEFAULT_MAX_POSITIONS = 512  # T5 has no position table; the engine still bounds its sequences


class T5FeedForward(nn.Module):
    """wo(act(wi x)), or gated: wo(act(wi_0 x) * wi_1 x) with wi_0 and wi_1 fused into `wi` (two shards)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.gated = config.is_gated_act
        self.d_ff = config.d_ff
        if self.gated:  # the activation takes half of wi's output
            self.wi = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)
            self.act = get_activation(config.dense_act_fn)
        else:
            self.wi = ActivatedLinear(config.d_model, config.d_ff, config.dense_act_fn, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.wo(self.wi(hidden))
        gate, linear = self.wi(hidden).split(self.d_ff, dim=-1)
        return self.wo(self.act(gate) * linear)


class T5Layer(nn.Module):
    """One encoder layer, or (with cross-attention) one decoder layer; pre-norm residual blocks."""

    def __init__(self, config, backend: AttentionBackend, is_decoder: bool, layer_index: int) -> None:
        super().__init__()
        d, eps = config.d_model, config.layer_norm_epsilon

        def attention(attn_type: AttentionType) -> EncDecAttention:
            return EncDecAttention(d, config.num_heads, attn_type, backend, layer_index=layer_index,
                                   head_dim=config.d_kv, bias=False, scaling=1.0)

        self.self_attn_layer_norm = RMSNorm(d, eps)
        self.self_attn = attention(AttentionType.DECODER if is_decoder else AttentionType.ENCODER)
        self.encoder_attn = None
        if is_decoder:
            self.encoder_attn_layer_norm = RMSNorm(d, eps)
            self.encoder_attn = attention(AttentionType.ENCODER_DECODER)
        self.final_layer_norm = RMSNorm(d, eps)
        self.ffn = T5FeedForward(config)

    def forward(self, hidden, kv_cache, metadata, encoder_hidden, position_bias: PositionBias) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden), kv_cache, metadata,
                                         position_bias=position_bias)
        if self.encoder_attn is not None:
            hidden = hidden + self.encoder_attn(self.encoder_attn_layer_norm(hidden), kv_cache, metadata,
                                                encoder_hidden)
        return hidden + self.ffn(self.final_layer_norm(hidden))


class T5Stack(nn.Module):
    def __init__(self, config, backend: AttentionBackend, is_decoder: bool, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        num_layers = config.num_decoder_layers if is_decoder else config.num_layers
        self.embed_tokens = embed_tokens
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.bidirectional = not is_decoder
        self.relative_attention_bias = nn.Embedding(self.num_buckets, config.num_heads)
        # The bucket of every relative position in [-max_distance, max_distance] (filled by reset()).
        self.register_buffer("bucket_index", torch.zeros(2 * self.max_distance + 1, dtype=torch.long),
                             persistent=False)
        self.layers = nn.ModuleList(T5Layer(config, backend, is_decoder, i) for i in range(num_layers))
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def reset(self) -> None:
        index, _ = t5_bucket_index(self.bidirectional, self.num_buckets, self.max_distance)
        self.bucket_index.copy_(index)

    def forward(self, input_ids, kv_caches, metadata, encoder_hidden=None) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, d_model]
        bias = t5_position_bias(self.relative_attention_bias.weight, self.bucket_index, -self.max_distance)
        hidden = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, kv_caches[i] if kv_caches else None, metadata, encoder_hidden, bias)
        return self.final_layer_norm(hidden)


# HF's names -> ours (after "encoder."/"decoder."): block i's sublayers are numbered, ours are named.
_RENAMES = [
    (re.compile(r"block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\."), "relative_attention_bias."),
    (re.compile(r"block\.(\d+)\.layer\.0\.SelfAttention\.([qkv])\."), r"layers.\1.self_attn.\2_proj."),
    (re.compile(r"block\.(\d+)\.layer\.0\.SelfAttention\.o\."), r"layers.\1.self_attn.out_proj."),
    (re.compile(r"block\.(\d+)\.layer\.0\.layer_norm\."), r"layers.\1.self_attn_layer_norm."),
    (re.compile(r"block\.(\d+)\.layer\.1\.EncDecAttention\.([qkv])\."), r"layers.\1.encoder_attn.\2_proj."),
    (re.compile(r"block\.(\d+)\.layer\.1\.EncDecAttention\.o\."), r"layers.\1.encoder_attn.out_proj."),
    (re.compile(r"block\.(\d+)\.layer\.\d\.DenseReluDense\."), r"layers.\1.ffn."),
]
_FFN_NORM = re.compile(r"^(encoder|decoder)\.block\.(\d+)\.layer\.([12])\.layer_norm\.")


def hf_to_ours(name: str) -> str:
    match = _FFN_NORM.match(name)
    if match:  # layer.1 is the encoder's FFN and the decoder's cross-attention; layer.2 the decoder's FFN
        stack, i, sub = match.groups()
        own = "final_layer_norm" if (stack, sub) in (("encoder", "1"), ("decoder", "2")) else "encoder_attn_layer_norm"
        return f"{stack}.layers.{i}.{own}." + name[match.end():]
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


class T5ForConditionalGeneration(nn.Module):
    is_encoder_decoder = True

    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.vocab_projection = VocabProjection()
        shared = nn.Embedding(config.vocab_size, config.d_model)  # a v5 save: everything tied (load_weights)
        self.encoder = T5Stack(config, backend, False, shared)
        self.decoder = T5Stack(config, backend, True, shared)
        self.lm_head: nn.Linear | None = None  # None: the decoder's embedding
        # HF (transformers 5): t5 scales the decoder output before the head when `scale_decoder_outputs`
        # (what `tie_word_embeddings` meant before); mT5 never does.
        default = getattr(config, "tie_word_embeddings", True)
        self.scale_output = config.model_type == "t5" and getattr(config, "scale_decoder_outputs", default)
        self.output_scale = config.d_model**-0.5

    def tied_weights(self) -> list[tuple[str, str]]:
        """transformers 5's tied (target, source) pairs, in its order."""
        if not getattr(self.config, "tie_word_embeddings", True):
            return []
        return [(ENCODER_EMBEDDING, SHARED), (DECODER_EMBEDDING, SHARED), (LM_HEAD, SHARED)]

    @property
    def max_decoder_len(self) -> int:
        return getattr(self.config, "n_positions", None) or _DEFAULT_MAX_POSITIONS

    @property
    def max_encoder_len(self) -> int:
        return self.max_decoder_len

    def default_decoder_prompt(self, generation_config=None) -> list[int]:
        """HF's generate starts from the decoder start token (<pad>)."""
        return [decoder_start_token_id(self.config, generation_config)]

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.config.num_decoder_layers, self.config.num_heads, self.config.d_kv)

    def encoder_num_positions(self, num_tokens: int) -> int:
        return num_tokens

    def encode(self, inputs: EncoderInputs, metadata: AttentionMetadata) -> torch.Tensor:
        """[num_encoder_tokens] ids -> [num_encoder_tokens, d_model] hidden states."""
        return self.encoder(inputs.input_ids, None, metadata)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]; T5 reads positions only through the attention views
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        encoder_hidden: torch.Tensor | None = None,  # prefill only
    ) -> torch.Tensor:  # [num_tokens, d_model]
        return self.decoder(input_ids, kv_caches, metadata, encoder_hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        if self.scale_output:
            hidden = hidden * self.output_scale
        if self.lm_head is None:
            return self.vocab_projection(hidden, self.decoder.embed_tokens.weight)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for stack in (self.encoder, self.decoder):
            stack.reset()
        loader = WeightLoader(self)
        loader.hold(SHARED, ENCODER_EMBEDDING, DECODER_EMBEDDING, LM_HEAD)
        loader.ignore(SHARED)  # only a source of the ties
        loader.ignore("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")  # as HF does
        for name, tensor in weights:
            name = hf_to_ours(name)
            if ".ffn.wi_" in name:  # gated: wi_0 (the gate) and wi_1 fused into wi
                shard = int(name.split(".ffn.wi_")[1][0])
                loader.load_shard(name.replace(f".ffn.wi_{shard}.", ".ffn.wi."), tensor, shard, 2)
            else:
                loader.load_attention(name, tensor)
        values = resolve_ties(self.tied_weights(), loader.held, usually_apart={LM_HEAD})  # v1.1, Flan, mT5
        # Share or separate the modules as the checkpoint's tensors are tied, then load them.
        if not tied(values, DECODER_EMBEDDING, ENCODER_EMBEDDING):
            self.decoder.embed_tokens = nn.Embedding(self.config.vocab_size, self.config.d_model)
        self.lm_head = None if tied(values, LM_HEAD, DECODER_EMBEDDING) else \
            nn.Linear(self.config.d_model, self.config.vocab_size, bias=False)
        loader.load_held(self, values)
        loader.finish(optional={"encoder.bucket_index", "decoder.bucket_index"})
