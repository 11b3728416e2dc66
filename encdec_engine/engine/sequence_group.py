"""A request as the engine holds it: its decoder `Sequence`s and the `SequenceGroup` they make.

A `SequenceGroup` is complete at construction: its sampling state, length limit, beam state and probes
are given then; what changes afterwards is what running it changes (sequences' tokens and status, the
probes' results, whether its cross KV was found cached, timestamps, an error).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from encdec_engine.probes import ProbeRequest, ProbeResults
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.sequence import EncoderSequence, SequenceData, SequenceStatus

if TYPE_CHECKING:
    from encdec_engine.engine.beam_search import BeamState
    from encdec_engine.layers.sampling_state import RequestSampling


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

    def append_token(self, token_id: int, logprob: float | None, top_logprobs: dict[int, float] | None) -> None:
        self.data.output_token_ids.append(token_id)
        if logprob is not None:  # None: the request reads no log-probabilities (the sampler skipped them)
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
        *,
        sampling: RequestSampling | None = None,
        max_len: int | None = None,
        beam: BeamState | None = None,
        probes: ProbeRequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.key = next(_group_keys)
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.encoder_seq = encoder_seq
        # The sampler's per-request state (the seeded generator, the processors' index tensors), built and
        # validated when the request was processed; None only in scheduler tests that run no model.
        self.sampling = sampling
        self.max_len = max_len  # decoder length limit (prompt + max_tokens, at most the model's)
        self.beam = beam  # a beam-search request's beams
        self.probes = probes  # what its prefill reports besides samples
        # -- what running it changes --
        self.probe_results = ProbeResults()
        self.encoder_cached = False  # its cross KV is already in the pool: skip the encoder
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.error: str | None = None  # why the request failed (finish_reason "error")

    @property
    def unreported_probes(self) -> ProbeRequest | None:
        """What its next prefill still has to report (None: nothing)."""
        return None if self.probes is None else self.probes.unreported(self.probe_results)

    @property
    def prefill_from(self) -> int | None:
        """The prefill computes the prompt from this position on, never from a cached prefix: the
        positions its probes read must be computed."""
        probes = self.unreported_probes
        return None if probes is None else probes.compute_from

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
