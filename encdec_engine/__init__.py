"""encdec-engine: a paged-KV serving engine for encoder/decoder transformers, for Python (LLM), a CLI and a server.

    __init__.py          the public names: LLM, SamplingParams, RequestOutput, CompletionOutput, prompt types
    llm.py               the offline API: LLM.generate, summarize, translate, transcribe, transcribe_iter,
                         transcribe_segments, transcribe_live
    config.py            EngineConfig: one dataclass, validated at construction
    compute_types.py     faster-whisper's compute types as the engine's quantization and dtype
    sampling_params.py   SamplingParams (vLLM names, Hugging Face semantics) and its caps
    outputs.py           RequestOutput, CompletionOutput: what a request gives back
    sequence.py          the records every layer shares: SequenceStatus, SequenceData, EncoderSequence
    probes.py            what a prefill reports besides samples: no-speech probability, prompt logprobs,
                         cross-attention weights
    cache.py             where the engine keeps what it makes once per machine (imported models, calibration)
    files.py             atomic files (written to a temporary name, synced, renamed)
    inputs/              prompts and their parsing, preprocessing, audio loading, the Whisper log-mel
    engine/              requests in, outputs out: scheduler, block manager, output processing, async engine
    worker/              the model runner: a step's flat inputs, the paged KV pool, CUDA graphs
    machine/             tuning to the machine: the CPU linear kernel, torch's threads, malloc
    attention/           attention metadata (a view per attention type), the layer, backends, kernels
    layers/              sampler, logits processors, linears, activations, norms, rotary embeddings
    quantization/        int8 weights and the int8 KV cache
    models/              the architectures (BART family, T5, Whisper, GPT-2, Llama) and their registry
    checkpoints/         reading checkpoints: weights, configs, tokenizers, the hub, model names
    translation/         text tasks above the engine: languages, each family's conventions, tasks
    speech/              the speech pipeline (Whisper): audio in, timed text out, offline and live
    server/              the OpenAI-compatible HTTP server
    cli/                 the `encdec` command
    distributed/         batch jobs and replicated serving on Ray (an optional extra)
"""

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
