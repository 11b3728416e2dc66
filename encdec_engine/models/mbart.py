"""mBART (MBartForConditionalGeneration; mBART-25 and mBART-50): BART with pre-norm layers and a final
layer norm per stack (models/bart_family.py). The decoder starts from </s> and, for translation, the
target language code is forced as the first generated token (forced_bos_token_id)."""

from __future__ import annotations

from encdec_engine.models.bart_family import FamilyModel, FamilySpec


class MBartForConditionalGeneration(FamilyModel):
    spec = FamilySpec(pre_norm=True, positions="learned", layernorm_embedding=True, final_logits_bias=True)
