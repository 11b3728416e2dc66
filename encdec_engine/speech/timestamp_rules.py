"""Whisper timestamp rules: Hugging Face's `WhisperTimeStampLogitsProcessor`, one row at a time.

Applied to one row of float32 logits, in HF's order:

1. `<|notimestamps|>` is never sampled (timestamp mode is on).
2. Timestamps come in pairs: after a closing pair (or a lone timestamp at the very
   start) the next token must be text; after one timestamp that follows text, the
   next must be a timestamp or eos, i.e. ids below eos are banned.
3. Timestamps never decrease: ids below the last timestamp are banned, and below
   last + 1 unless the last token opened a pair (so `<|0.00|>` is not repeated).
4. At the first generated position only timestamps are allowed, at most
   `timestamp_begin + max_initial_timestamp_index`.
5. If the total probability of all timestamps beats every single other token,
   every non-timestamp token is banned.

Everything from `timestamp_begin` to the end of the row counts as a timestamp,
including any padding columns beyond the tokenizer's vocab, as in HF.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class TimestampRules:
    """Per-row logits processor, `(output_token_ids, logits[vocab]) -> None`, editing in place.

    `output_token_ids` are the tokens generated after the decoder prompt: HF's
    `input_ids[begin_index:]` with `begin_index` = prompt length.
    """

    # id of `<|0.00|>`; every id from here to the end of the row is a timestamp.
    timestamp_begin: int
    # id of `<|notimestamps|>`, always banned here.
    no_timestamps_token_id: int
    # HF bans `[:eos]` after an opening timestamp, so eos and the special tokens
    # between eos and the timestamps stay allowed there.
    eos_token_id: int
    # Latest allowed first timestamp, in 0.02 s steps past `<|0.00|>`; None: no limit.
    max_initial_timestamp_index: int | None
    # HF's `_detect_timestamp_from_logprob`: force a timestamp when their summed
    # probability beats the best text token.
    detect_from_logprob: bool = True

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> None:
        begin = self.timestamp_begin
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # Edited through a numpy view of the row: each fill and reduction below costs 1-7 us there,
            # 4-25 through torch (this rule ran ~0.1 ms of a ~5 ms tiny.en int8 step).
            logits = logits.numpy()
        logits[self.no_timestamps_token_id] = NEG_INF

        seq = output_token_ids
        last_was_timestamp = len(seq) >= 1 and seq[-1] >= begin
        # HF treats "fewer than two tokens" as a timestamp here, so a timestamp as
        # the first generated token closes a pair on its own.
        penultimate_was_timestamp = len(seq) < 2 or seq[-2] >= begin
        if last_was_timestamp:
            if penultimate_was_timestamp:
                logits[begin:] = NEG_INF
            else:
                logits[: self.eos_token_id] = NEG_INF

        timestamp_last = begin  # no timestamp is banned until one is sampled
        timestamps = [t for t in seq if t >= begin]
        if timestamps:
            # An opening timestamp may be repeated to close its pair; otherwise the
            # next timestamp must be strictly later.
            if last_was_timestamp and not penultimate_was_timestamp:
                timestamp_last = timestamps[-1]
            else:
                timestamp_last = timestamps[-1] + 1
        logits[begin:timestamp_last] = NEG_INF

        if not seq:
            logits[:begin] = NEG_INF
            if self.max_initial_timestamp_index is not None:
                logits[begin + self.max_initial_timestamp_index + 1 :] = NEG_INF

        if self.detect_from_logprob:
            # Over the already-edited scores, as HF does. HF compares log-probabilities; the log-softmax
            # normalizer is common to both sides, so the logits are compared (no pass over the vocab).
            if _logsumexp(logits[begin:]) > logits[:begin].max():
                logits[:begin] = NEG_INF


def _logsumexp(x: torch.Tensor | np.ndarray) -> float:
    """log(sum(exp(x))) of a float32 row, a tensor or a numpy array; -inf if every entry is."""
    if isinstance(x, torch.Tensor):
        return float(x.float().logsumexp(dim=-1))
    top = x.max()
    if top == NEG_INF:
        return NEG_INF
    return float(top + np.log(np.exp(x - top).sum()))


def timestamp_rules_from_generation_config(gc: Any) -> TimestampRules:
    """Rules from a Whisper checkpoint's HF `GenerationConfig`, read the way HF reads it."""
    eos = gc.eos_token_id or gc.bos_token_id  # HF falls back to bos when eos is unset
    if isinstance(eos, (list, tuple)):
        # HF slices `[:eos]`, which needs one id; Whisper checkpoints have exactly one.
        if len(eos) != 1:
            raise ValueError(f"timestamp rules need a single eos_token_id, got {eos}")
        eos = eos[0]
    return TimestampRules(
        timestamp_begin=gc.no_timestamps_token_id + 1,  # HF derives it, never reads it
        no_timestamps_token_id=gc.no_timestamps_token_id,
        eos_token_id=eos,
        max_initial_timestamp_index=getattr(gc, "max_initial_timestamp_index", None),
        detect_from_logprob=getattr(gc, "_detect_timestamp_from_logprob", True),
    )
