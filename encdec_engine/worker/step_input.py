"""What the model runner sees of one scheduled request for one step. The runner reads it and returns
results per row (step_output.py); it never writes into the request."""

from __future__ import annotations

from dataclasses import dataclass

from encdec_engine.layers.sampling_state import RequestSampling
from encdec_engine.probes import ProbeRequest
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.sequence import EncoderSequence, SequenceData


@dataclass
class SequenceGroupMetadata:
    """What the model runner needs of one scheduled group for one step."""

    request_id: str
    is_prompt: bool  # prefill step (encoder + decoder prompt) or decode step
    seq_data: dict[int, SequenceData]  # decoder seq id -> its tokens
    sampling_params: SamplingParams
    block_tables: dict[int, list[int]]  # decoder seq id -> self-attention blocks
    encoder_seq_data: EncoderSequence | None = None
    cross_block_table: list[int] | None = None  # the group's cross-attention blocks
    encoder_cached: bool = False  # cross KV already cached: no encoder run for this group
    # Chunked prefill: the prompt tokens this step computes when they are not all the rest (None); such a
    # chunk samples nothing
    token_chunk_size: int | None = None
    sampling: RequestSampling | None = None  # the group's sampler state (generator, processor tensors)
    max_len: int | None = None  # decoder length limit (forced EOS fills its last slot)
    fanout: int = 1  # samples drawn for the row: best_of at the first token of a request that forks
    probes: ProbeRequest | None = None  # what this prefill reports besides samples (None: nothing)
