"""Per-request sampler state, built once when a request is added (never inside a step).

Everything a request's logits processors need besides its tokens is turned
into index tensors here, and its seeded generator is made here: a bad value
(a seed torch cannot take) is then a `ValueError` for that request alone, and
each step only indexes. Bad words are indexed by the token before their last
one, so a step checks only the words the sequence could be completing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from encdec_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class BadWords:
    """HF's `bad_words_ids` rule, indexed: one-token words are always banned; a longer word's last
    token is banned where the sequence ends with the word's other tokens."""

    always: list[int] = field(default_factory=list)  # last tokens of one-token words
    # the token before a word's last one -> (the word's other tokens, its last token)
    by_previous: dict[int, list[tuple[tuple[int, ...], int]]] = field(default_factory=dict)

    @classmethod
    def build(cls, words: list[list[int]]) -> BadWords:
        always, by_previous = [], {}
        for word in words:
            if len(word) == 1:
                always.append(word[0])
            else:
                by_previous.setdefault(word[-2], []).append((tuple(word[:-1]), word[-1]))
        return cls(always, by_previous)

    def banned(self, tokens: list[int]) -> list[int]:
        """The tokens to ban after `tokens` (HF `NoBadWordsLogitsProcessor`)."""
        out = list(self.always)
        if tokens:
            for prefix, last in self.by_previous.get(tokens[-1], ()):
                if len(prefix) <= len(tokens) and tuple(tokens[len(tokens) - len(prefix) :]) == prefix:
                    out.append(last)
        return out


def _index(ids, device: torch.device) -> torch.Tensor | None:
    if ids is None:
        return None
    if isinstance(ids, range):  # e.g. every text token: no list of 50,000 Python ints per step
        return torch.arange(ids.start, ids.stop, ids.step, dtype=torch.long, device=device)
    return torch.tensor(list(ids), dtype=torch.long, device=device)


@dataclass
class RequestSampling:
    """The sampler state of one request (shared by its forked sequences)."""

    generator: torch.Generator | None  # a seeded request's own stream of random numbers
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids: end a sequence
    eos_token_ids: frozenset[int]  # EOS ids that count as EOS for this request (stop_reason None)
    min_tokens_ban: torch.Tensor | None  # [k] stop ids within the vocabulary, banned before min_tokens
    logit_bias_ids: torch.Tensor | None  # [k]
    logit_bias_values: torch.Tensor | None  # [k] float32
    suppress: torch.Tensor | None  # [k] banned at every step
    begin_suppress: torch.Tensor | None  # [k] banned at the first generated position
    allowed: torch.Tensor | None  # [k] only these may be generated
    bad_words: BadWords | None

    @classmethod
    def build(cls, params: SamplingParams, eos_token_ids, vocab_size: int, device: torch.device) -> RequestSampling:
        """Raises ValueError for a value torch cannot take (named by its SamplingParams field)."""
        generator = None
        if params.seed is not None:
            try:
                generator = torch.Generator(device=device).manual_seed(params.seed)
            except (RuntimeError, OverflowError, TypeError, ValueError) as e:
                raise ValueError(f"SamplingParams.seed {params.seed!r} cannot seed a generator ({e})") from None
        stops = params.all_stop_token_ids(eos_token_ids)
        in_vocab = sorted(t for t in stops if t < vocab_size)
        bias = params.logit_bias or {}
        return cls(
            generator=generator,
            stop_token_ids=frozenset(stops),
            eos_token_ids=frozenset() if params.ignore_eos else frozenset(eos_token_ids),
            min_tokens_ban=_index(in_vocab, device) if params.min_tokens and in_vocab else None,
            logit_bias_ids=_index(list(bias), device) if bias else None,
            logit_bias_values=torch.tensor(list(bias.values()), dtype=torch.float32, device=device) if bias else None,
            suppress=_index(params.suppress_tokens or None, device),
            begin_suppress=_index(params.begin_suppress_tokens or None, device),
            allowed=_index(params.allowed_token_ids, device),
            bad_words=BadWords.build(params.bad_words_token_ids) if params.bad_words_token_ids else None,
        )
