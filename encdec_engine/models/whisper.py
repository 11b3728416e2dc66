"""Whisper (WhisperForConditionalGeneration) over the engine's paged attention.

Encoder: two 1-D convolutions (the second with stride 2, so 3000 mel frames
become 1500 positions) + fixed positional embeddings, then pre-norm layers.
Decoder: token + learned positional embeddings, pre-norm layers with
cross-attention, output projection tied to the token embeddings (untied when
the config says so, or the checkpoint holds its own with other values, as in
transformers 5). As in HF, queries are scaled before attention (k has no
bias), which keeps rounding identical to `generate`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from encdec_engine.attention.backends.base import AttentionBackend
from encdec_engine.attention.metadata import AttentionMetadata
from encdec_engine.layers.linear import VocabProjection
from encdec_engine.models.encdec_layers import EncDecLayer, decoder_kv_cache_spec
from encdec_engine.models.interface import EncoderInputs, KVCacheSpec
from encdec_engine.checkpoints.whisper.tokens import WhisperTokens
from encdec_engine.checkpoints.weights import WeightLoader, resolve_ties, tied

_EMBEDDING, _HEAD = "decoder.embed_tokens.weight", "proj_out.weight"  # held until their tie is known


class WhisperEncoder(nn.Module):
    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(EncDecLayer(config, backend, False, pre_norm=True, prescale_query=True) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor | list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        # features: [num_requests, n_mels, 2 * positions] -> [num_requests * positions, d_model] (1500 positions
        # for a whole window), or a list of [n_mels, 2 * positions_i] (windows cut to their audio_ctx) -> the
        # requests' positions one after another, as the metadata's block-diagonal view reads them
        if isinstance(features, list):
            hidden = torch.cat([self.embed(f.unsqueeze(0)) for f in features])
        else:
            hidden = self.embed(features)
        for layer in self.layers:
            hidden = layer(hidden, None, metadata)
        return self.layer_norm(hidden)

    def embed(self, features: torch.Tensor) -> torch.Tensor:
        """[n, n_mels, 2 * positions] -> [n * positions, d_model]: the convolutions and the first `positions`
        positional embeddings (features in the weights' dtype: log-mels come as fp32)."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(features.to(self.conv1.weight.dtype))))).permute(0, 2, 1)
        return (x + self.embed_positions.weight[: x.shape[1]]).reshape(-1, x.shape[-1])


class WhisperDecoder(nn.Module):
    def __init__(self, config, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = nn.Embedding(config.max_target_positions, config.d_model)
        self.layers = nn.ModuleList(EncDecLayer(config, backend, True, pre_norm=True, prescale_query=True, layer_index=i)
                                    for i in range(config.decoder_layers))
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
        self.vocab_projection = VocabProjection()
        self.encoder = WhisperEncoder(config, backend)
        self.decoder = WhisperDecoder(config, backend)
        # HF ties proj_out to the token embedding under tie_word_embeddings, unless the checkpoint holds its
        # own with other values (load_weights).
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        self.proj_out = None if self.tie_word_embeddings else self._proj_out()

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
        return decoder_kv_cache_spec(self.config)

    def encoder_num_positions(self, num_inputs: int) -> int:
        return self.config.max_source_positions  # every window is 30 s: 3000 frames -> 1500 positions

    def default_decoder_prompt(self, generation_config=None) -> list[int]:
        return WhisperTokens.from_configs(self.config, generation_config).decoder_prompt()

    def linears_with_outlier_inputs(self) -> list[nn.Module]:
        """The linears whose inputs have outliers, which one 8-bit scale over a block of rows loses:
        each encoder layer's fc2. Its input is the GELU of 1,500 positions, heavy-tailed (on tiny.en
        a layer's reaches 556 where most values are below 1). Measured on 44 clips (tiny.en, greedy):
        every linear in fbgemm's int8 (a 7-bit scale per 512 rows) decoded 29 clips to the fp32 tokens,
        10.5% WER against fp32's 9.1%; these 4 in fp32, 35 clips and 8.2%. Under quantization="int8"
        they take a scale per row where the machine allows (machine/cpu_kernels.py), else fp32."""
        return [layer.fc2 for layer in self.encoder.layers]

    # Its encoder shares no weight with its decoder: it may run in another dtype (compute type int8_bfloat16,
    # engine/loader.py), its output taken by the cross K/V projections in its own
    encoder_runs_apart = True

    def encode(self, inputs: EncoderInputs, metadata: AttentionMetadata) -> torch.Tensor:
        return self.encoder(inputs.features, metadata)

    def forward(self, input_ids, positions, kv_caches, metadata, encoder_hidden=None) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, metadata, encoder_hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab]
        if self.proj_out is None:
            return self.vocab_projection(hidden, self.decoder.embed_tokens.weight)
        return self.proj_out(hidden)

    def _proj_out(self) -> nn.Linear:
        return nn.Linear(self.config.d_model, self.config.vocab_size, bias=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        loader.hold(_EMBEDDING, _HEAD)
        for name, tensor in weights:
            loader.load_attention(name.removeprefix("model."), tensor)
        values = resolve_ties([(_HEAD, _EMBEDDING)] if self.tie_word_embeddings else [], loader.held)
        self.proj_out = None if tied(values, _HEAD, _EMBEDDING) else (self.proj_out or self._proj_out())
        loader.load_held(self, values)
        loader.zero_missing_bias_shards()
        loader.finish()
