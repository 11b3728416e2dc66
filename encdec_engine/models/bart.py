"""BART (BartForConditionalGeneration): the BART family's post-norm layers, learned positions (offset 2)
and layernorm_embedding, a final logits bias (models/bart_family.py)."""

from __future__ import annotations

from encdec_engine.models.bart_family import FamilyModel, FamilySpec


class BartForConditionalGeneration(FamilyModel):
    spec = FamilySpec(pre_norm=False, positions="learned", layernorm_embedding=True, final_logits_bias=True)

    def default_decoder_prompt(self, generation_config=None) -> list[int]:
        """HF starts from the decoder start token and forces BOS next: [2, 0] for BART."""
        return [self.config.decoder_start_token_id, self.config.bos_token_id]
