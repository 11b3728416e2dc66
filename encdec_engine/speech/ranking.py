"""Which of a window's candidates (best_of samples or beams) is kept, and its mean log-probability,
as openai-whisper's `DecodingTask` decides them.

A window's request returns every candidate: `best_of` samples at a temperature above 0, every
finished beam with beam search, one sequence when greedy. Each candidate's score is its summed
log-probability over its length (`MaximumLikelihoodRanker`):

    sum_logprob = sum of the log-probabilities of the generated tokens, the <|endoftext|> included
    length      = generated tokens before <|endoftext|>
    score       = sum_logprob / length                              (length_penalty None)
                = sum_logprob / ((5 + length) / 6) ** length_penalty (Google NMT's alpha)
    avg_logprob = sum_logprob / (length + 1)                        (what the fallback rules judge)

The log-probabilities are those of the distribution each token was drawn from, after the logits
processors and before the temperature, as openai-whisper's. Ranking by the summed log-probability
alone (vLLM's best_of) keeps the shortest sample: a sample that stops after a few words beats
a full transcript, and the window is then skipped as silence.
"""

from __future__ import annotations

from dataclasses import dataclass

from encdec_engine.outputs import CompletionOutput, RequestOutput


@dataclass(frozen=True)
class Candidate:
    """One decoded sequence of a window, as the ranking sees it."""

    tokens: list[int]  # the generated tokens before <|endoftext|>
    sum_logprob: float  # over the generated tokens, <|endoftext|> included

    @property
    def avg_logprob(self) -> float:
        """openai-whisper's mean: the <|endoftext|> counts in the length (the +1)."""
        return self.sum_logprob / (len(self.tokens) + 1)

    def score(self, length_penalty: float | None) -> float:
        """The MaximumLikelihoodRanker's score: higher is better."""
        length = len(self.tokens)
        penalty = length if length_penalty is None else ((5 + length) / 6) ** length_penalty
        return self.sum_logprob / penalty if penalty else self.sum_logprob


def candidate(completion: CompletionOutput, eot: int) -> Candidate:
    """A completion as a Candidate; the engine's summed log-probability counts the <|endoftext|>."""
    tokens = list(completion.token_ids)
    if eot in tokens:
        tokens = tokens[: tokens.index(eot)]
    if completion.cumulative_logprob is None:
        raise ValueError("a window's request must return log-probabilities (cumulative_logprob) to be ranked")
    return Candidate(tokens, completion.cumulative_logprob)


def best_candidate(out: RequestOutput, eot: int, length_penalty: float | None) -> Candidate:
    """The best-scoring candidate of a finished window request (the first on a tie, as np.argmax)."""
    candidates = [candidate(c, eot) for c in out.outputs]
    scores = [c.score(length_penalty) for c in candidates]
    return candidates[scores.index(max(scores))]
