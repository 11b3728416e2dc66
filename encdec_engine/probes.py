"""What a request asks its prefill to report besides its samples, and what the prefill reports back.

Whisper's transcription reads three things of each window's prompt: the probability of <|nospeech|>
right after <|startoftranscript|> (openai-whisper's no_speech_prob), the log-probability of each prompt
token (vLLM's prompt_logprobs) and the cross-attention weights of chosen heads (for word timestamps).
One typed object carries them each way:

    SamplingParams --LLMEngine.process_request--> ProbeRequest (the probed position resolved)
      -> SequenceGroup.probes -> SequenceGroupMetadata.probes (a prefill, while anything is unreported)
      -> ModelRunner -> StepOutput.probes[group index]: ProbeResults
      -> OutputProcessor -> SequenceGroup.probe_results -> RequestOutput.probes
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ProbeRequest:
    no_speech_token_id: int | None = None  # report this token's probability ...
    no_speech_position: int | None = None  # ... from the logits at this prompt position (the last start token)
    prompt_logprobs: int | None = None  # report each prompt token's log-prob and this many top alternatives
    cross_attention_heads: tuple[tuple[int, int], ...] | None = None  # report these (layer, head) pairs' weights

    @property
    def empty(self) -> bool:
        return self.no_speech_token_id is None and self.prompt_logprobs is None and self.cross_attention_heads is None

    @property
    def compute_from(self) -> int | None:
        """The first prompt position the prefill must compute rather than take from a cached prefix:
        the whole prompt for prompt logprobs and attention, the probed position for no_speech_prob."""
        if self.prompt_logprobs is not None or self.cross_attention_heads is not None:
            return 0
        return self.no_speech_position

    def unreported(self, results: ProbeResults) -> ProbeRequest | None:
        """What is still to report after `results` (a prefill recomputed after preemption reports nothing
        twice); None when nothing is."""
        left = replace(
            self,
            no_speech_token_id=None if results.no_speech_prob is not None else self.no_speech_token_id,
            no_speech_position=None if results.no_speech_prob is not None else self.no_speech_position,
            prompt_logprobs=None if results.prompt_logprobs is not None else self.prompt_logprobs,
            cross_attention_heads=None if results.cross_attentions is not None else self.cross_attention_heads,
        )
        return None if left.empty else left


def no_speech_position(decoder_ids: list[int], start_token_id: int | None) -> int:
    """The prompt position whose next-token distribution gives no_speech_prob: the last decoder start
    token (a previous-text prompt comes before it)."""
    if start_token_id is None or start_token_id not in decoder_ids:
        raise ValueError(f"no_speech_token_id needs the decoder start token ({start_token_id}) in the decoder prompt")
    return len(decoder_ids) - 1 - decoder_ids[::-1].index(start_token_id)


@dataclass
class ProbeResults:
    no_speech_prob: float | None = None
    # vLLM's layout: None for the first prompt token, then {token_id: logprob} with the token and its top-k
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cross_attentions: torch.Tensor | None = None  # [pairs, prompt tokens, encoder positions]

    def update(self, reported: ProbeResults) -> None:
        """Take what a prefill reported (each probe once)."""
        for f in fields(self):
            value = getattr(reported, f.name)
            if value is not None:
                setattr(self, f.name, value)
