"""Marian (MarianMTModel, the OPUS-MT models): post-norm layers over Marian's sinusoidal positions, no
layernorm_embedding, a final logits bias (models/bart_family.py). The decoder starts from <pad>.

Embeddings as transformers 5 ties them: with `share_encoder_decoder_embeddings` (the default) Marian
is BART's rule, everything `shared` under `tie_word_embeddings` and nothing tied without it; without
it the encoder and decoder embeddings are separate, the decoder's of `decoder_vocab_size` rows, and
`tie_word_embeddings` ties only the head (of the decoder's rows, as final_logits_bias) to the decoder's."""

from __future__ import annotations

from encdec_engine.checkpoints.weights import DECODER_EMBEDDING, LM_HEAD
from encdec_engine.models.bart_family import FamilyModel, FamilySpec


class MarianMTModel(FamilyModel):
    spec = FamilySpec(pre_norm=False, positions="sinusoidal", layernorm_embedding=False, final_logits_bias=True)

    @classmethod
    def tied_weights(cls, config) -> list[tuple[str, str]]:
        if not getattr(config, "tie_word_embeddings", True) or _shares(config):
            return super().tied_weights(config)
        return [(LM_HEAD, DECODER_EMBEDDING)]

    @staticmethod
    def decoder_vocab_size(config) -> int:
        return getattr(config, "decoder_vocab_size", None) or config.vocab_size

    @staticmethod
    def head_vocab_size(config) -> int:
        return config.vocab_size if _shares(config) else MarianMTModel.decoder_vocab_size(config)


def _shares(config) -> bool:
    return getattr(config, "share_encoder_decoder_embeddings", True)
