"""encdec-engine: a paged-KV serving engine for encoder/decoder transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from encdec_engine.inputs.prompts import ExplicitEncoderDecoderPrompt, TextPrompt, TokensPrompt
    from encdec_engine.llm import LLM
    from encdec_engine.outputs import CompletionOutput, RequestOutput
    from encdec_engine.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TextPrompt", "TokensPrompt",
           "ExplicitEncoderDecoderPrompt"]


def __getattr__(name: str):
    """The public names, imported on first use (lazy: `encdec_engine.llm` takes 4 s to import, torch and
    transformers included, which `encdec --help` and the CLI's argument checks must not pay)."""
    if name == "LLM":
        from encdec_engine.llm import LLM as value  # lazy: torch, transformers (4 s)
    elif name == "SamplingParams":
        from encdec_engine.sampling_params import SamplingParams as value  # lazy: as the others
    elif name == "RequestOutput":
        from encdec_engine.outputs import RequestOutput as value  # lazy: as the others
    elif name == "CompletionOutput":
        from encdec_engine.outputs import CompletionOutput as value  # lazy: as the others
    elif name == "TextPrompt":
        from encdec_engine.inputs.prompts import TextPrompt as value  # lazy: as the others
    elif name == "TokensPrompt":
        from encdec_engine.inputs.prompts import TokensPrompt as value  # lazy: as the others
    elif name == "ExplicitEncoderDecoderPrompt":
        from encdec_engine.inputs.prompts import ExplicitEncoderDecoderPrompt as value  # lazy: as the others
    else:
        raise AttributeError(f"module 'encdec_engine' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
