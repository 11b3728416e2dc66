"""Logits processors with Hugging Face semantics, applied in HF's order.

Each processor edits the float32 logits of the rows that use it, in place.
Row state comes from `SamplingRow`: the decoder prompt, the tokens generated
so far, the request's sampling params and the sampler state built when the
request was added (`RequestSampling`: index tensors, the seeded generator).
A row whose processors raise is reported, not raised: its request fails
alone and the other rows of the batch are sampled as if it were not there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encdec_engine.layers.sampling_state import RequestSampling
from encdec_engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One decoder sequence to sample a token for."""

    params: SamplingParams
    prompt_token_ids: list[int]  # decoder prompt
    output_token_ids: list[int]
    state: RequestSampling | None = None  # None only for rows that use no processor (tests of truncation)
    max_len: int | None = None  # decoder length limit (prompt + max_tokens): forced_eos fills its last slot

    @property
    def generator(self) -> torch.Generator | None:
        return self.state.generator if self.state is not None else None

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


def banned_ngram_tokens(tokens: list[int], n: int) -> list[int]:
    """Tokens that would repeat an n-gram already in `tokens` (HF no_repeat_ngram_size)."""
    if len(tokens) + 1 < n:
        return []
    prefix = tuple(tokens[len(tokens) - n + 1 :])
    return [tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tuple(tokens[i : i + n - 1]) == prefix]


def _force(logits: torch.Tensor, token_id: int) -> None:
    logits.fill_(NEG_INF)
    logits[token_id] = 0.0


def apply_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> dict[int, str]:
    """Apply every configured processor to each row of `logits` [num_rows, vocab]. Returns the rows
    whose processors raised, with the error; such a row's logits are zeroed (its sample is void)."""
    errors: dict[int, str] = {}
    for i, row in enumerate(rows):
        try:
            _apply_row(logits[i], row)
        except Exception as e:  # a user's processor, or a bug on one request's data: that request alone
            errors[i] = f"{type(e).__name__}: {e}"
            logits[i].zero_()
    return errors


def _apply_row(x: torch.Tensor, row: SamplingRow) -> None:
    p, state, out = row.params, row.state, row.output_token_ids
    if state.logit_bias_ids is not None:
        x[state.logit_bias_ids] += state.logit_bias_values.to(x.dtype)
    if p.repetition_penalty != 1.0:
        apply_repetition_penalty(x, row)
    if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        apply_presence_frequency_penalties(x, row)
    if p.no_repeat_ngram_size > 0:
        banned = banned_ngram_tokens(row.token_ids, p.no_repeat_ngram_size)
        if banned:
            x[banned] = NEG_INF
    if state.bad_words is not None:
        banned = state.bad_words.banned(row.token_ids)
        if banned:
            x[banned] = NEG_INF
    if len(out) < p.min_tokens and state.min_tokens_ban is not None:
        x[state.min_tokens_ban] = NEG_INF
    # HF: BOS is forced only after a one-token decoder prompt, and pushes begin-suppression one step on.
    bos_forced = p.forced_bos_token_id is not None and len(row.prompt_token_ids) == 1
    if bos_forced and not out:
        _force(x, p.forced_bos_token_id)
    if p.forced_eos_token_id is not None and row.max_len is not None and len(row.token_ids) == row.max_len - 1:
        _force(x, p.forced_eos_token_id)
    if state.suppress is not None:
        x[state.suppress] = NEG_INF
    if state.begin_suppress is not None and len(out) == bos_forced:
        x[state.begin_suppress] = NEG_INF
    if state.allowed is not None:
        allowed = x[state.allowed].clone()
        x.fill_(NEG_INF)
        x[state.allowed] = allowed
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
