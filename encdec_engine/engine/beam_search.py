"""Beam search with Hugging Face `generate(num_beams=...)` semantics, one request at a time.

Each step takes the processed log-probabilities of the group's running beams
and decides, exactly as HF does (same float32 arithmetic, same `topk` over
the flattened [num_beams * vocab] scores):

- the top 2k candidates (k = num_beams; one EOS token),
- which of them finish (EOS or the length limit) among the top k, scored by
  sum_logprobs / generated_len ** length_penalty, merged into the k best
  finished hypotheses,
- the k best unfinished candidates, which become the next running beams
  (parent beam index + token),
- whether the search is over (early_stopping True / False / "never").

The engine turns the parent indices into forks of paged block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_NEG = -1.0e9  # HF's "impossible" score


@dataclass
class BeamStep:
    parents: list[int]  # for each new running beam, the index of the beam it extends
    tokens: list[int]  # the token each new running beam appends
    done: bool


@dataclass
class BeamState:
    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    prompt_len: int  # decoder prompt length (HF's decoder_prompt_len)
    max_length: int  # prompt_len + max_tokens
    eos_token_ids: tuple[int, ...]  # HF: every generation-config EOS id finishes a beam
    running_scores: torch.Tensor = field(init=False)  # [num_beams]
    finished_scores: torch.Tensor = field(init=False)  # [num_beams] length-normalized, -1e9 when empty
    finished_tokens: list[list[int]] = field(init=False)  # generated tokens of each finished slot
    finished: torch.Tensor = field(init=False)  # [num_beams] bool: slot holds a finished hypothesis
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied (sticky)

    def __post_init__(self) -> None:
        k = self.num_beams
        self.running_scores = torch.zeros(k)
        self.running_scores[1:] = _NEG  # only beam 0 is real before the first step
        self.finished_scores = torch.full((k,), _NEG)
        self.finished_tokens = [[] for _ in range(k)]
        self.finished = torch.zeros(k, dtype=torch.bool)

    def step(self, log_probs: torch.Tensor, generated: list[list[int]]) -> BeamStep:
        """log_probs: [num_running, vocab] processed log-probs (1 row at the first step);
        generated: the tokens each running beam has generated so far."""
        k = self.num_beams
        if log_probs.shape[0] == 1 and k > 1:  # HF starts with k identical beams
            log_probs = log_probs.expand(k, -1)
            generated = generated * k
        vocab = log_probs.shape[1]
        cur_len = self.prompt_len + len(generated[0])
        scores = (log_probs + self.running_scores[:, None]).reshape(-1)
        keep = max(2, 1 + len(self.eos_token_ids)) * k
        top_scores, top_idx = torch.topk(scores, k=keep)
        beam_idx, token_ids = top_idx // vocab, top_idx % vocab
        hits = torch.isin(token_ids, torch.tensor(self.eos_token_ids, dtype=token_ids.dtype))
        if cur_len + 1 >= self.max_length:
            hits = torch.ones_like(hits)
        candidates = [generated[b] + [t] for b, t in zip(beam_idx.tolist(), token_ids.tolist())]

        # Next running beams: the best k candidates that did not finish.
        running = top_scores + hits.to(torch.float32) * _NEG
        next_idx = torch.topk(running, k=k)[1]
        self.running_scores = running[next_idx]

        # Finished hypotheses: candidates among the top k that finished, merged with the old ones.
        top_mask = torch.arange(keep) < k
        just_finished = hits & top_mask
        normalized = top_scores / ((cur_len + 1 - self.prompt_len) ** self.length_penalty)
        full = bool(self.finished.all()) and self.early_stopping is True
        normalized += torch.tensor(float(full)) * _NEG
        normalized += torch.tensor(float(not self.improvable)) * _NEG
        normalized += (~just_finished) * _NEG
        merged_scores = torch.cat((self.finished_scores, normalized))
        merged_tokens = self.finished_tokens + candidates
        merged_finished = torch.cat((self.finished, just_finished))
        best = torch.topk(merged_scores, k=k)[1]
        self.finished_scores = merged_scores[best]
        self.finished_tokens = [merged_tokens[i] for i in best.tolist()]
        self.finished = merged_finished[best]

        cur_len += 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = cur_len - self.prompt_len
        best_possible = self.running_scores[:1] / (best_len**self.length_penalty)
        worst_finished = torch.where(self.finished, torch.min(self.finished_scores), -1.0e9)
        self.improvable = self.improvable and bool(torch.any(best_possible > worst_finished))
        done = not (self.improvable and not (bool(self.finished.all()) and self.early_stopping is True)
                    and not bool(hits.all()))
        picked = next_idx.tolist()
        return BeamStep([int(beam_idx[i]) for i in picked], [int(token_ids[i]) for i in picked], done)

    def cap(self, generated: list[list[int]]) -> None:
        """End the search early (the request outgrew the KV pool): the running beams
        become hypotheses scored at their current length, as at the length limit."""
        for tokens, score in zip(generated, self.running_scores.tolist()):
            if tokens and score > _NEG:
                self._keep_best(score / len(tokens) ** self.length_penalty, tokens)

    def _keep_best(self, score: float, tokens: list[int]) -> None:
        worst = int(torch.argmin(self.finished_scores))
        if score > float(self.finished_scores[worst]):
            self.finished_scores[worst], self.finished_tokens[worst], self.finished[worst] = score, tokens, True
            order = torch.argsort(self.finished_scores, descending=True, stable=True)
            self.finished_scores, self.finished = self.finished_scores[order], self.finished[order]
            self.finished_tokens = [self.finished_tokens[i] for i in order.tolist()]

    def best(self, n: int) -> list[tuple[list[int], float]]:
        """The n best finished hypotheses (tokens, normalized score), best first."""
        return [(self.finished_tokens[i], float(self.finished_scores[i])) for i in range(min(n, self.num_beams))]
