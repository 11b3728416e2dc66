"""M2M100 and NLLB-200 (M2M100ForConditionalGeneration): pre-norm layers and a final layer norm per
stack over fairseq's sinusoidal positions (counted from the padding index + 1), no layernorm_embedding,
no logits bias (models/bart_family.py). The decoder starts from </s>; the target language token is
forced first (forced_bos_token_id)."""

from __future__ import annotations

from encdec_engine.models.bart_family import FamilyModel, FamilySpec


class M2M100ForConditionalGeneration(FamilyModel):
    spec = FamilySpec(pre_norm=True, positions="fairseq", layernorm_embedding=False, final_logits_bias=False)
