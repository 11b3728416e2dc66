"""Which of our model classes serves a Hugging Face architecture."""

from __future__ import annotations

import importlib

# HF architecture name -> (module under encdec_engine.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "BartForConditionalGeneration": ("bart", "BartForConditionalGeneration"),
    "BartModel": ("bart", "BartForConditionalGeneration"),
    "WhisperForConditionalGeneration": ("whisper", "WhisperForConditionalGeneration"),
    "T5ForConditionalGeneration": ("t5", "T5ForConditionalGeneration"),
    "MT5ForConditionalGeneration": ("t5", "T5ForConditionalGeneration"),
    "MBartForConditionalGeneration": ("mbart", "MBartForConditionalGeneration"),
    "MarianMTModel": ("marian", "MarianMTModel"),
    "M2M100ForConditionalGeneration": ("m2m100", "M2M100ForConditionalGeneration"),
    # Decoder-only models: the degenerate case (no encoder, no cross cache).
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(hf_config) -> type:
    archs = list(getattr(hf_config, "architectures", None) or [])
    default_for_type = {"bart": "BartForConditionalGeneration", "whisper": "WhisperForConditionalGeneration",
                        "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "t5": "T5ForConditionalGeneration",
                        "mt5": "MT5ForConditionalGeneration", "mbart": "MBartForConditionalGeneration",
                        "marian": "MarianMTModel", "m2m_100": "M2M100ForConditionalGeneration"}
    if not archs and getattr(hf_config, "model_type", None) in default_for_type:
        archs = [default_for_type[hf_config.model_type]]
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(f"encdec_engine.models.{module}"), name)
    raise ValueError(f"unsupported model architecture {archs or hf_config.model_type!r}; "
                     f"supported: {', '.join(supported_architectures())}")
