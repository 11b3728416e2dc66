"""Which of our model classes serves a checkpoint: one registration per model family."""

from __future__ import annotations

from dataclasses import dataclass

from encdec_engine.models.bart import BartForConditionalGeneration
from encdec_engine.models.gpt2 import GPT2LMHeadModel
from encdec_engine.models.llama import LlamaForCausalLM
from encdec_engine.models.m2m100 import M2M100ForConditionalGeneration
from encdec_engine.models.marian import MarianMTModel
from encdec_engine.models.mbart import MBartForConditionalGeneration
from encdec_engine.models.t5 import T5ForConditionalGeneration
from encdec_engine.models.whisper import WhisperForConditionalGeneration


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type: serves a config that names no architecture
    model_class: type
    architectures: tuple[str, ...]  # config.json's `architectures` names it serves


FAMILIES = (
    Family("bart", BartForConditionalGeneration, ("BartForConditionalGeneration", "BartModel")),
    Family("whisper", WhisperForConditionalGeneration, ("WhisperForConditionalGeneration",)),
    Family("t5", T5ForConditionalGeneration, ("T5ForConditionalGeneration",)),
    Family("mt5", T5ForConditionalGeneration, ("MT5ForConditionalGeneration",)),
    Family("mbart", MBartForConditionalGeneration, ("MBartForConditionalGeneration",)),
    Family("marian", MarianMTModel, ("MarianMTModel",)),
    Family("m2m_100", M2M100ForConditionalGeneration, ("M2M100ForConditionalGeneration",)),
    # Decoder-only models: the degenerate case (no encoder, no cross cache).
    Family("gpt2", GPT2LMHeadModel, ("GPT2LMHeadModel",)),
    Family("llama", LlamaForCausalLM, ("LlamaForCausalLM",)),
)
_BY_ARCHITECTURE = {arch: family.model_class for family in FAMILIES for arch in family.architectures}
_BY_TYPE = {family.model_type: family.model_class for family in FAMILIES}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def resolve_model_class(hf_config) -> type:
    """The class of the first architecture config.json names that a family serves; with none named,
    the family of its model_type."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _BY_TYPE:
        return _BY_TYPE[model_type]
    raise ValueError(f"unsupported model architecture {archs or model_type!r}; "
                     f"supported: {', '.join(supported_architectures())}")
