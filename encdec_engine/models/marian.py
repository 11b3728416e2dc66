"""Marian (MarianMTModel, the OPUS-MT models): post-norm layers over Marian's sinusoidal positions, no
layernorm_embedding, a final logits bias (models/bart_family.py). The decoder starts from <pad>. The
encoder and decoder embeddings may be separate (`share_encoder_decoder_embeddings=False`), the
decoder's then of `decoder_vocab_size` rows."""

from __future__ import annotations

from encdec_engine.models.bart_family import FamilyModel, FamilySpec


class MarianMTModel(FamilyModel):
    spec = FamilySpec(pre_norm=False, positions="sinusoidal", layernorm_embedding=False, final_logits_bias=True)

    @staticmethod
    def shares_embeddings(config) -> bool:
        return getattr(config, "share_encoder_decoder_embeddings", True)

    @staticmethod
    def target_vocab_size(config) -> int:
        if getattr(config, "share_encoder_decoder_embeddings", True):
            return config.vocab_size
        return getattr(config, "decoder_vocab_size", None) or config.vocab_size
