"""What the model runner expects of a model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from encdec_engine.attention.metadata import AttentionMetadata
from encdec_engine.checkpoints.weights import WeightLoader, resolve_ties, tied


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int  # decoder layers with a paged cache (self and cross share it)
    num_kv_heads: int
    head_dim: int


@dataclass
class EncoderInputs:
    """Flat encoder inputs of a prefill step: token ids (text) or features (audio)."""

    input_ids: torch.Tensor | None = None  # [num_encoder_tokens]
    positions: torch.Tensor | None = None  # [num_encoder_tokens]
    # [num_requests, n_mels, n_frames], or a list of [n_mels, n_frames_i] where the requests' lengths differ
    features: torch.Tensor | list[torch.Tensor] | None = None


def stack_features(features: list[torch.Tensor], device: torch.device) -> torch.Tensor | list[torch.Tensor]:
    """One batched tensor of the requests' features where their lengths agree (every full window), else
    the list (windows cut to their `audio_ctx`), each on `device`."""
    if all(f.shape == features[0].shape for f in features):
        return torch.stack(features).to(device)
    return [f.to(device) for f in features]


class Model(Protocol):
    is_encoder_decoder: bool
    kv_cache_spec: KVCacheSpec

    def encoder_num_positions(self, num_inputs: int) -> int:
        """Encoder output positions (= cross KV slots) for an input of this length."""

    def encode(self, inputs: EncoderInputs, metadata: AttentionMetadata) -> torch.Tensor:
        """[num_encoder_positions, hidden] for the flat batch of encoder inputs."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        encoder_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[num_tokens, hidden] decoder states for the flat batch."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class DecoderOnlyModel:
    """Base for decoder-only models: the degenerate case with no encoder and no cross cache."""

    is_encoder_decoder = False
    max_encoder_len = 0
    token_embedding: str  # attribute name of the input embedding, the output head when `lm_head` is None (tied)
    tie_word_embeddings: bool  # the config's: the head tied to the embedding (unless the checkpoint unties it)

    @property
    def max_decoder_len(self) -> int:
        return self.config.max_position_embeddings

    def new_head(self) -> nn.Linear:
        return nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)

    def load_tied_head(self, loader: WeightLoader) -> None:
        """Load the held token embedding and head (`loader.hold`), the head tied to the embedding as
        transformers 5 ties it: under tie_word_embeddings, unless the checkpoint holds its own with
        other values."""
        embedding = f"{self.token_embedding}.weight"
        ties = [("lm_head.weight", embedding)] if self.tie_word_embeddings else []
        values = resolve_ties(ties, loader.held)
        self.lm_head = None if tied(values, "lm_head.weight", embedding) else (self.lm_head or self.new_head())
        loader.load_held(self, values)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        if self.lm_head is None:  # tied to the input embedding
            return self.vocab_projection(hidden, getattr(self, self.token_embedding).weight)
        return self.lm_head(hidden)

    def encoder_num_positions(self, num_inputs: int) -> int:
        raise ValueError(f"{type(self).__name__} is decoder-only: it has no encoder")

    def encode(self, inputs: EncoderInputs, metadata: AttentionMetadata) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} is decoder-only: it has no encoder")
