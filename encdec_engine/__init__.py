"""encdec-engine: a paged-KV serving engine for encoder/decoder transformers."""

from encdec_engine.inputs.prompts import ExplicitEncoderDecoderPrompt, TextPrompt, TokensPrompt
from encdec_engine.llm import LLM
from encdec_engine.outputs import CompletionOutput, RequestOutput
from encdec_engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "TextPrompt",
    "TokensPrompt",
    "ExplicitEncoderDecoderPrompt",
]
__version__ = "0.1.0"
