"""Logits processors with Hugging Face semantics, applied in HF's order.

Each processor edits the float32 logits of the rows that use it, in place.
Row state comes from `SamplingRow`: the decoder prompt, the tokens generated
so far and the request's sampling params.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encdec_engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One decoder sequence to sample a token for."""

    params: SamplingParams
    prompt_token_ids: list[int]  # decoder prompt
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_len: int | None = None  # decoder length limit (prompt + max_tokens): forced_eos fills its last slot

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def apply_repetition_penalty(logits: torch.Tensor, row: SamplingRow) -> None:
    """CTRL penalty over every decoder token seen: divide positive logits, multiply negative."""
    ids = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=logits.device)
    scores = logits[ids]
    penalty = row.params.repetition_penalty
    logits[ids] = torch.where(scores < 0, scores * penalty, scores / penalty)


def apply_presence_frequency_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """vLLM/OpenAI: logit -= frequency_penalty * count + presence_penalty, over generated tokens."""
    if not row.output_token_ids:
        return
    ids, counts = torch.tensor(row.output_token_ids, device=logits.device).unique(return_counts=True)
    p = row.params
    logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty


def banned_bad_word_tokens(tokens: list[int], bad_words: list[list[int]]) -> list[int]:
    """Last tokens of the bad words whose other tokens end `tokens` (HF NoBadWordsLogitsProcessor)."""
    return [word[-1] for word in bad_words
            if len(word) == 1 or (len(word) - 1 <= len(tokens) and tokens[len(tokens) - len(word) + 1 :] == word[:-1])]


def banned_ngram_tokens(tokens: list[int], n: int) -> list[int]:
    """Tokens that would repeat an n-gram already in `tokens` (HF no_repeat_ngram_size)."""
    if len(tokens) + 1 < n:
        return []
    prefix = tuple(tokens[len(tokens) - n + 1 :])
    return [tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tuple(tokens[i : i + n - 1]) == prefix]


def _force(logits: torch.Tensor, token_id: int) -> None:
    logits.fill_(NEG_INF)
    logits[token_id] = 0.0


def apply_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Apply every configured processor to each row of `logits` [num_rows, vocab]."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p, out = row.params, row.output_token_ids
        x = logits[i]
        if p.logit_bias:
            x[list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=x.device)
        if p.repetition_penalty != 1.0:
            apply_repetition_penalty(x, row)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            apply_presence_frequency_penalties(x, row)
        if p.no_repeat_ngram_size > 0:
            banned = banned_ngram_tokens(row.token_ids, p.no_repeat_ngram_size)
            if banned:
                x[banned] = NEG_INF
        if p.bad_words_token_ids:
            banned = banned_bad_word_tokens(row.token_ids, p.bad_words_token_ids)
            if banned:
                x[banned] = NEG_INF
        if len(out) < p.min_tokens:
            stop_ids = [t for t in p.all_stop_token_ids(row.eos_token_ids) if t < vocab]
            if stop_ids:
                x[stop_ids] = NEG_INF
        # HF: BOS is forced only after a one-token decoder prompt, and pushes begin-suppression one step on.
        bos_forced = p.forced_bos_token_id is not None and len(row.prompt_token_ids) == 1
        if bos_forced and not out:
            _force(x, p.forced_bos_token_id)
        if p.forced_eos_token_id is not None and row.max_len is not None and len(row.token_ids) == row.max_len - 1:
            _force(x, p.forced_eos_token_id)
        if p.suppress_tokens:
            x[p.suppress_tokens] = NEG_INF
        if p.begin_suppress_tokens and len(out) == bos_forced:
            x[p.begin_suppress_tokens] = NEG_INF
        if p.allowed_token_ids is not None:
            allowed = x[p.allowed_token_ids].clone()
            x.fill_(NEG_INF)
            x[p.allowed_token_ids] = allowed
        for processor in p.logits_processors or ():
            processor(out, x)


def apply_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p truncation, row by row params; returns new logits."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
    logits = logits / temps[:, None]
    vocab = logits.shape[1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.tensor(top_k, device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)
        drop = ranks[None, :] >= k[:, None]
        probs = sorted_logits.masked_fill(drop, NEG_INF).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = probs.cumsum(dim=-1) - probs
        drop |= before >= torch.tensor(top_p, dtype=probs.dtype, device=logits.device)[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p, dtype=probs.dtype, device=logits.device)[:, None]
        logits = logits.masked_fill(probs < threshold * probs.max(dim=-1, keepdim=True).values, NEG_INF)
    return logits
