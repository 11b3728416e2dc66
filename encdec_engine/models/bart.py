"""BART (BartForConditionalGeneration) over the engine's paged attention.

Post-norm encoder/decoder with learned positions (offset 2), optional
sqrt(d_model) embedding scale, tied output embeddings and a final logits
bias. Self-attention q/k/v and cross-attention k/v are fused into one
projection each; `load_weights` maps Hugging Face names onto them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from encdec_engine.attention.backends.base import AttentionBackend
from encdec_engine.attention.metadata import AttentionMetadata
from encdec_engine.layers.linear import VocabProjection
from encdec_engine.models.encdec_layers import EncDecLayer, decoder_kv_cache_spec
from encdec_engine.models.interface import EncoderInputs, KVCacheSpec
from encdec_engine.checkpoints.weights import WeightLoader

_POSITION_OFFSET = 2  # BART's learned positions start at index 2


class BartStack(nn.Module):
    def __init__(self, config, backend: AttentionBackend, is_decoder: bool, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        num_layers = config.decoder_layers if is_decoder else config.encoder_layers
        self.embed_tokens = embed_tokens
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_positions = nn.Embedding(config.max_position_embeddings + _POSITION_OFFSET, config.d_model)
        self.layernorm_embedding = nn.LayerNorm(config.d_model)
        self.layers = nn.ModuleList(EncDecLayer(config, backend, is_decoder, pre_norm=False, layer_index=i)
                                    for i in range(num_layers))

    def forward(self, input_ids, positions, kv_caches, metadata, encoder_hidden=None) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids) * self.embed_scale
        hidden = self.layernorm_embedding(embeds + self.embed_positions(positions + _POSITION_OFFSET))
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, kv_caches[i] if kv_caches else None, metadata, encoder_hidden)
        return hidden


class BartForConditionalGeneration(nn.Module):
    is_encoder_decoder = True

    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.vocab_projection = VocabProjection()
        # Tied (the usual case): one embedding serves encoder, decoder and output.
        # Untied (HF v5): encoder, decoder and lm_head each have their own.
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)

        def embedding() -> nn.Embedding:
            return nn.Embedding(config.vocab_size, config.d_model)

        self.shared = embedding() if self.tie_word_embeddings else None
        self.encoder = BartStack(config, backend, False, self.shared or embedding())
        self.decoder = BartStack(config, backend, True, self.shared or embedding())
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(config.vocab_size))

    @property
    def max_decoder_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def max_encoder_len(self) -> int:
        return self.config.max_position_embeddings

    def default_decoder_prompt(self, generation_config=None) -> list[int]:
        """HF starts from the decoder start token and forces BOS next: [2, 0] for BART."""
        return [self.config.decoder_start_token_id, self.config.bos_token_id]

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return decoder_kv_cache_spec(self.config)

    def encoder_num_positions(self, num_tokens: int) -> int:
        return num_tokens

    def encode(self, inputs: EncoderInputs, metadata: AttentionMetadata) -> torch.Tensor:
        """[num_encoder_tokens] ids -> [num_encoder_tokens, d_model] hidden states."""
        return self.encoder(inputs.input_ids, inputs.positions, None, metadata)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # one per decoder layer
        metadata: AttentionMetadata,
        encoder_hidden: torch.Tensor | None = None,  # prefill only
    ) -> torch.Tensor:  # [num_tokens, d_model]
        return self.decoder(input_ids, positions, kv_caches, metadata, encoder_hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        if self.lm_head is None:  # tied to the input embedding
            return self.vocab_projection(hidden, self.decoder.embed_tokens.weight) + self.final_logits_bias
        return self.lm_head(hidden) + self.final_logits_bias

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        if self.tie_word_embeddings:
            for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
                loader.alias(name, "shared.weight")
        else:
            loader.ignore("shared.weight")  # HF keeps it, but untied models never read it
        for name, tensor in weights:
            name = name.removeprefix("model.")
            loader.load_attention(name, tensor.reshape(-1) if name == "final_logits_bias" else tensor)
        loader.finish(optional={"final_logits_bias"})
