"""Sequences, the groups a request is made of, and what the runner sees of them.

A request is one `SequenceGroup`: one or more decoder `Sequence`s (n > 1,
beam search) that share one `EncoderSequence`. The encoder sequence is static
after prefill; its `num_positions` is how many cross-attention KV slots it
needs (its tokens for BART, frames after the conv stride for Whisper).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from encdec_engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # applying its result raised, or its step failed: this request alone ends

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
            SequenceStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass
class SequenceData:
    """Token ids of one decoder sequence and how many of them sit in the KV cache."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose self-attention KV is cached

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class EncoderSequence:
    """The encoder input of a request: token ids (text) or features (audio)."""

    num_positions: int  # encoder output positions = cross-attention KV slots
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    features: Any = None  # e.g. a log-mel tensor [n_mels, n_frames] for Whisper
    cache_key: Any = None  # identity of the encoder input for output reuse (None: never cached)


class Sequence:
    """One decoder sequence: its tokens, status, logprob and detokenized text."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], prompt: str | None = None) -> None:
        self.seq_id = seq_id
        self.data = SequenceData(list(prompt_token_ids))
        self.prompt = prompt
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, float]] = []
        self.output_text = ""
        self.stop_reason: int | str | None = None
        # Incremental detokenizer state (see engine/detokenizer.py).
        self.tokens: list[str] | None = None
        self.prefix_offset = 0
        self.read_offset = 0

    def __len__(self) -> int:
        return len(self.data)

    @property
    def output_token_ids(self) -> list[int]:
        return self.data.output_token_ids

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next forward pass must feed for this sequence."""
        return len(self.data) - self.data.num_computed_tokens

    def append_token(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None) -> None:
        self.data.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.output_logprobs.append(top_logprobs)

    def fork(self, seq_id: int) -> Sequence:
        """A copy under a new id: same tokens, cache progress, logprobs and detokenizer state."""
        child = Sequence(seq_id, self.data.prompt_token_ids, self.prompt)
        child.data.output_token_ids = list(self.data.output_token_ids)
        child.data.num_computed_tokens = self.data.num_computed_tokens
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.output_logprobs = list(self.output_logprobs)
        child.output_text = self.output_text
        child.tokens = None if self.tokens is None else list(self.tokens)
        child.prefix_offset, child.read_offset = self.prefix_offset, self.read_offset
        return child

    def reset_for_recompute(self) -> None:
        """Forget the cache: the next prefill recomputes prompt and outputs."""
        self.data.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def is_finished(self) -> bool:
        return self.status.is_finished


# Group keys are unique for the life of the process, unlike request ids (which callers choose and may
# reuse once a request is gone): the block manager keys a group's cross table by it.
_group_keys = itertools.count()


class SequenceGroup:
    """All sequences of one request, sharing its encoder sequence and sampling params."""

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float,
        encoder_seq: EncoderSequence | None = None,
    ) -> None:
        self.request_id = request_id
        self.key = next(_group_keys)
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.encoder_seq = encoder_seq
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # Per-request sampler state (layers.sampling_state.RequestSampling: the seeded generator, index
        # tensors of the processors), built and validated when the request is added.
        self.sampling: Any = None
        self.error: str | None = None  # why the request failed (finish_reason "error")
        self.beam: Any = None  # BeamState of a beam-search request
        self.encoder_cached = False  # its cross KV is already in the pool: skip the encoder
        self.max_len: int | None = None  # decoder length limit (prompt + max_tokens, at most the model's)
        # Prompt position whose next-token distribution gives no_speech_prob (SamplingParams.no_speech_token_id).
        self.no_speech_position: int | None = None
        self.no_speech_prob: float | None = None  # from the prefill's result
        # The prefill computes the prompt from this position on, never from a cached prefix (a no-speech
        # probe, prompt logprobs and cross-attention capture need their positions computed).
        self.prefill_from: int | None = None
        self.prompt_logprobs: list | None = None  # from the first prefill's result, when asked for
        self.cross_attentions = None  # [pairs, prompt tokens, encoder positions], likewise

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status == status]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.encoder_seq is not None

    def num_unfinished_seqs(self) -> int:
        return len(self.unfinished_seqs())


@dataclass
class SequenceGroupMetadata:
    """What the model runner needs of one scheduled group for one step. The runner reads it and
    returns results per row; it never writes into the request (the engine applies the results)."""

    request_id: str
    is_prompt: bool  # prefill step (encoder + decoder prompt) or decode step
    seq_data: dict[int, SequenceData]  # decoder seq id -> its tokens
    sampling_params: SamplingParams
    block_tables: dict[int, list[int]]  # decoder seq id -> self-attention blocks
    encoder_seq_data: EncoderSequence | None = None
    cross_block_table: list[int] | None = None  # the group's cross-attention blocks
    encoder_cached: bool = False  # cross KV already cached: no encoder run for this group
    sampling: Any = None  # the group's RequestSampling (generator, processor tensors)
    max_len: int | None = None  # decoder length limit (forced EOS fills its last slot)
    fanout: int = 1  # samples drawn for the row: best_of at the first token of a request that forks
    no_speech_position: int | None = None  # prompt position probed for no_speech_prob
    want_prompt_logprobs: bool = False  # report prompt logprobs in this prefill
    want_cross_attentions: bool = False  # capture the cross-attention heads in this prefill
