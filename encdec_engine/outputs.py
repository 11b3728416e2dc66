"""What a request gives back (vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from encdec_engine.probes import ProbeResults


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: {token_id: logprob}
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    error: str | None = None  # finish_reason "error": what failed (the other requests went on)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompts and its sequences so far."""

    request_id: str
    prompt: str | None  # decoder prompt text, when known
    prompt_token_ids: list[int]  # decoder prompt tokens
    encoder_prompt: str | None
    encoder_prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # What its prefill reported besides samples, when SamplingParams asked (no_speech_token_id,
    # prompt_logprobs, cross_attention_heads); None when nothing was asked.
    probes: ProbeResults | None = None
    # Set when the request failed (its outputs end with finish_reason "error"): processing its result
    # raised, or the step that ran it failed. Only this request (or that step's batch) is affected.
    error: str | None = None

    def record(self) -> dict:
        """The JSON record `encdec generate` (and its Ray job) writes: the first completion's text, token ids
        and finish reason, every completion under "outputs" when there are several (n > 1), and "error"
        when the request failed."""
        first = self.outputs[0]
        record = {"request_id": self.request_id, "text": first.text, "token_ids": list(first.token_ids),
                  "finish_reason": first.finish_reason}
        if len(self.outputs) > 1:
            record["outputs"] = [{"text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
                                 for c in self.outputs]
        if self.error is not None:
            record["error"] = self.error
        return record

    @property
    def no_speech_prob(self) -> float | None:
        return None if self.probes is None else self.probes.no_speech_prob

    @property
    def prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        """vLLM's: None for the first prompt token, then {token_id: logprob} with the token and its top-k."""
        return None if self.probes is None else self.probes.prompt_logprobs

    @property
    def cross_attentions(self):  # torch.Tensor [pairs, prompt tokens, encoder positions]
        return None if self.probes is None else self.probes.cross_attentions

