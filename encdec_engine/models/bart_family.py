"""The BART family: BART, mBART, Marian and M2M100 (NLLB) are one encoder/decoder with switches.

    switch                      BART      mBART     Marian          M2M100 / NLLB
    layer norm                  post      pre       post            pre
    final layer norm per stack  -         yes       -               yes
    layernorm_embedding         yes       yes       -               -
    positions                   learned   learned   sinusoidal      sinusoidal (fairseq's), after the
                                (+2)      (+2)      (sin | cos)     padding index; pad tokens at its row
    embedding scale             sqrt(d_model) when config.scale_embedding (all four)
    final_logits_bias           yes       yes       yes             -

Each model file states its `FamilySpec` and its default decoder prompt; the stack, the embeddings (tied
as transformers 5 ties them: `FamilyModel.tied_weights`) and the weight names are here. Layers are
`EncDecLayer` (models/encdec_layers.py), the attention and residual block Whisper uses too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from encdec_engine.attention.backends.base import AttentionBackend
from encdec_engine.attention.metadata import AttentionMetadata
from encdec_engine.checkpoints.generation_config import decoder_start_token_id
from encdec_engine.checkpoints.weights import (DECODER_EMBEDDING, ENCODER_EMBEDDING, LM_HEAD, SHARED,
                                              WeightLoader, resolve_ties, tied)
from encdec_engine.layers.linear import VocabProjection
from encdec_engine.models.encdec_layers import EncDecLayer, decoder_kv_cache_spec
from encdec_engine.models.interface import EncoderInputs, KVCacheSpec


@dataclass(frozen=True)
class FamilySpec:
    pre_norm: bool  # pre-norm layers, and a final layer norm after each stack
    positions: str  # "learned" (offset 2), "sinusoidal" (Marian's), "fairseq" (M2M100's, after the padding index)
    layernorm_embedding: bool  # a layer norm over token + position embeddings
    final_logits_bias: bool  # a [vocab] bias buffer added to the logits


class LearnedPositions(nn.Module):
    """BART's and mBART's learned positions: row `position + 2` of a table of max_positions + 2."""

    offset = 2

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_positions + self.offset, dim))

    def forward(self, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(positions + self.offset, self.weight)

    def reset(self) -> None:
        pass


class SinusoidalPositions(nn.Module):
    """Fixed sinusoids, computed here as HF computes them (never read from the checkpoint, which may
    not have them: transformers does not save them).

    Marian: row p = [sin(p / 10000^(2i/d)) ..., cos(...)...] (numpy float64, then float32), from row 0.
    fairseq (M2M100, NLLB): half-dim log-spaced frequencies in float32, rows from `padding_idx + 1`;
    a pad token takes the all-zero row `padding_idx` (HF: pad tokens keep the padding position), the
    rows of the other tokens count every token, as HF's do at decode."""

    def __init__(self, max_positions: int, dim: int, kind: str, padding_idx: int | None) -> None:
        super().__init__()
        self.kind, self.dim, self.padding_idx = kind, dim, padding_idx
        self.offset = 0 if kind == "sinusoidal" else padding_idx + 1
        self.register_buffer("weight", torch.zeros(max_positions + self.offset, dim), persistent=False)

    def reset(self) -> None:
        """Fill the table (after the loader zeroed every buffer)."""
        rows = self.weight.shape[0]
        table = marian_sinusoids(rows, self.dim) if self.kind == "sinusoidal" else \
            fairseq_sinusoids(rows, self.dim, self.padding_idx)
        with torch.no_grad():
            self.weight.copy_(table)

    def forward(self, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        rows = positions + self.offset
        if self.kind == "fairseq":
            rows = torch.where(input_ids == self.padding_idx, self.padding_idx, rows)
        return self.weight.index_select(0, rows)


def marian_sinusoids(num_positions: int, dim: int) -> torch.Tensor:
    """MarianSinusoidalPositionalEmbedding.create_weight."""
    position_enc = np.array([[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)]
                             for pos in range(num_positions)])
    out = torch.empty(num_positions, dim)
    sentinel = dim // 2 if dim % 2 == 0 else dim // 2 + 1
    out[:, 0:sentinel] = torch.FloatTensor(np.sin(position_enc[:, 0::2]))
    out[:, sentinel:] = torch.FloatTensor(np.cos(position_enc[:, 1::2]))
    return out


def fairseq_sinusoids(num_positions: int, dim: int, padding_idx: int | None) -> torch.Tensor:
    """M2M100SinusoidalPositionalEmbedding.get_embedding."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    args = torch.arange(num_positions, dtype=torch.int64).float().unsqueeze(1) * freqs.unsqueeze(0)
    table = torch.cat([torch.sin(args), torch.cos(args)], dim=1).view(num_positions, -1)
    if dim % 2 == 1:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    if padding_idx is not None:
        table[padding_idx, :] = 0
    return table


class FamilyStack(nn.Module):
    def __init__(self, config, spec: FamilySpec, backend: AttentionBackend, is_decoder: bool,
                 embed_tokens: nn.Embedding) -> None:
        super().__init__()
        d = config.d_model
        num_layers = config.decoder_layers if is_decoder else config.encoder_layers
        self.embed_tokens = embed_tokens
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        if spec.positions == "learned":
            self.embed_positions = LearnedPositions(config.max_position_embeddings, d)
        else:
            self.embed_positions = SinusoidalPositions(config.max_position_embeddings, d, spec.positions,
                                                       config.pad_token_id)
        self.layernorm_embedding = nn.LayerNorm(d) if spec.layernorm_embedding else None
        self.layers = nn.ModuleList(EncDecLayer(config, backend, is_decoder, pre_norm=spec.pre_norm, layer_index=i)
                                    for i in range(num_layers))
        self.layer_norm = nn.LayerNorm(d) if spec.pre_norm else None

    def forward(self, input_ids, positions, kv_caches, metadata, encoder_hidden=None) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> [num_tokens, d_model]
        hidden = self.embed_tokens(input_ids) * self.embed_scale + self.embed_positions(positions, input_ids)
        if self.layernorm_embedding is not None:
            hidden = self.layernorm_embedding(hidden)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, kv_caches[i] if kv_caches else None, metadata, encoder_hidden)
        return hidden if self.layer_norm is None else self.layer_norm(hidden)


class FamilyModel(nn.Module):
    """A BART-family encoder/decoder; subclasses set `spec` (and `default_decoder_prompt`).

    Embeddings are tied as transformers 5 ties them (`tied_weights`): with `tie_word_embeddings`, the
    encoder's and decoder's token embeddings and the output head are all `shared` (Marian without
    `share_encoder_decoder_embeddings`: the head is the decoder's embedding, of `decoder_vocab_size`
    rows); without it, or where the checkpoint holds a tied pair with different values, each its own.
    The modules follow the config at construction and the checkpoint at load; `shared` itself is
    never read (HF's forward does not read it either), only a source of the ties."""

    is_encoder_decoder = True
    spec: ClassVar[FamilySpec]

    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.vocab_projection = VocabProjection()
        ties = dict(self.tied_weights(config))  # HF's sources are never targets: one step finds the source

        def source(name: str) -> str:
            return ties.get(name, name)

        encoder_embed = self._embedding(config.vocab_size)
        decoder_embed = encoder_embed if source(DECODER_EMBEDDING) == source(ENCODER_EMBEDDING) else \
            self._embedding(self.decoder_vocab_size(config))
        self.encoder = FamilyStack(config, self.spec, backend, False, encoder_embed)
        self.decoder = FamilyStack(config, self.spec, backend, True, decoder_embed)
        self.lm_head = None if source(LM_HEAD) == source(DECODER_EMBEDDING) else self._head()
        if self.spec.final_logits_bias:
            self.register_buffer("final_logits_bias", torch.zeros(self.head_vocab_size(config)))
        else:
            self.final_logits_bias = None

    @classmethod
    def tied_weights(cls, config) -> list[tuple[str, str]]:
        """transformers 5's tied (target, source) pairs, in its order: none without tie_word_embeddings."""
        if not getattr(config, "tie_word_embeddings", True):
            return []
        return [(LM_HEAD, SHARED), (DECODER_EMBEDDING, SHARED), (ENCODER_EMBEDDING, SHARED)]

    @staticmethod
    def decoder_vocab_size(config) -> int:
        """Rows of the decoder's own token embedding."""
        return config.vocab_size

    @staticmethod
    def head_vocab_size(config) -> int:
        """Rows of an own output head (and of final_logits_bias)."""
        return config.vocab_size

    def _embedding(self, rows: int) -> nn.Embedding:
        return nn.Embedding(rows, self.config.d_model)

    def _head(self) -> nn.Linear:
        return nn.Linear(self.config.d_model, self.head_vocab_size(self.config), bias=False)

    @property
    def max_decoder_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def max_encoder_len(self) -> int:
        return self.config.max_position_embeddings

    def default_decoder_prompt(self, generation_config=None) -> list[int]:
        """HF's generate starts from the decoder start token."""
        return [decoder_start_token_id(self.config, generation_config)]

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
        if self.lm_head is None:  # tied to the decoder's input embedding; the bias added by the matmul
            return self.vocab_projection(hidden, self.decoder.embed_tokens.weight, self.final_logits_bias)
        logits = self.lm_head(hidden)
        return logits if self.final_logits_bias is None else logits.add_(self.final_logits_bias)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for stack in (self.encoder, self.decoder):
            stack.embed_positions.reset()
        loader = WeightLoader(self)
        loader.hold(SHARED, ENCODER_EMBEDDING, DECODER_EMBEDDING, LM_HEAD)
        loader.ignore(SHARED)  # only a source of the ties
        if self.final_logits_bias is None:
            loader.ignore("final_logits_bias")
        computed = set()
        if self.spec.positions != "learned":  # fixed sinusoids: computed, whatever the checkpoint holds
            computed = {f"{stack}.embed_positions.weight" for stack in ("encoder", "decoder")}
            for name in computed | {f"{stack}.embed_positions.weights" for stack in ("encoder", "decoder")}:
                loader.ignore(name)
        for name, tensor in weights:
            name = name.removeprefix("model.")
            loader.load_attention(name, tensor.reshape(-1) if name == "final_logits_bias" else tensor)
        values = resolve_ties(self.tied_weights(self.config), loader.held)
        # Share or separate the modules as the checkpoint's tensors are tied, then load them.
        if tied(values, DECODER_EMBEDDING, ENCODER_EMBEDDING):
            self.decoder.embed_tokens = self.encoder.embed_tokens
        elif self.decoder.embed_tokens is self.encoder.embed_tokens:
            self.decoder.embed_tokens = self._embedding(self.decoder_vocab_size(self.config))
        if tied(values, LM_HEAD, DECODER_EMBEDDING):
            self.lm_head = None
        elif self.lm_head is None:
            self.lm_head = self._head()
        loader.load_held(self, values)
        loader.finish(optional={"final_logits_bias"} | computed)
