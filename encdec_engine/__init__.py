"""encdec-engine: a paged-KV serving engine for encoder/decoder transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from encdec_engine.inputs.prompts import ExplicitEncoderDecoderPrompt, TextPrompt, TokensPrompt
    from encdec_engine.llm import LLM
    from encdec_engine.outputs import CompletionOutput, RequestOutput
    from encdec_engine.sampling_params import SamplingParams

__version__ = "0.1.0"

# The public names, imported on first use: `encdec --help` and argument checks must not pay for torch.
_EXPORTS = {
    "LLM": "encdec_engine.llm",
    "SamplingParams": "encdec_engine.sampling_params",
    "RequestOutput": "encdec_engine.outputs",
    "CompletionOutput": "encdec_engine.outputs",
    "TextPrompt": "encdec_engine.inputs.prompts",
    "TokensPrompt": "encdec_engine.inputs.prompts",
    "ExplicitEncoderDecoderPrompt": "encdec_engine.inputs.prompts",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'encdec_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
