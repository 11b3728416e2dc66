"""The records every layer shares about a request's sequences: their status, a decoder sequence's tokens
(`SequenceData`) and the encoder input (`EncoderSequence`).

A request is one `SequenceGroup` (engine/sequence_group.py): one or more decoder sequences (n > 1,
beam search) that share one `EncoderSequence`. The encoder sequence is static after prefill; its
`num_positions` is how many cross-attention KV slots it needs (its tokens for BART, frames after the
conv stride for Whisper).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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
    features: torch.Tensor | None = None  # audio: the log-mel torch.Tensor [n_mels, n_frames] (Whisper)
    cache_key: Hashable | None = None  # identity of the encoder input for output reuse (None: never cached)
