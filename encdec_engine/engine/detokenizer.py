"""Incremental detokenization: turn each new token into the text it adds.

Decoding tokens one by one breaks multi-byte characters and merges spaces
differently, so (like vLLM) we keep a small window of already-emitted tokens
(`prefix_offset:read_offset`) and emit the difference between decoding the
window with and without the new tokens, holding back text that ends in an
incomplete character. When the sequence ends, what is held is written out (`flush`), so the final
text is transformers' `decode` of the tokens: a character cut off by the token limit ends in U+FFFD
there too.
"""

from __future__ import annotations

from encdec_engine.engine.sequence_group import Sequence

_INCOMPLETE = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []))

    def _to_string(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def step(self, seq: Sequence, skip_special_tokens: bool) -> str:
        """Append the text of the sequence's newest token to `seq.output_text`; return it."""
        token_id = seq.output_token_ids[-1]
        if seq.tokens is None:
            seq.tokens = []
        if skip_special_tokens and token_id in self.special_ids:
            return ""
        # An id the tokenizer has no string for (a vocabulary padded past the tokenizer) adds no text, as in vLLM.
        seq.tokens.extend(t or "" for t in self.tokenizer.convert_ids_to_tokens([token_id]))
        return self._advance(seq, hold_incomplete=True)

    def flush(self, seq: Sequence) -> str:
        """The sequence has ended: append the text held back for an incomplete character; return it."""
        return self._advance(seq, hold_incomplete=False) if seq.tokens else ""

    def _advance(self, seq: Sequence, hold_incomplete: bool) -> str:
        """Append the text the window's unread tokens add (none yet if it ends in an incomplete character
        and `hold_incomplete`); return it."""
        prefix = self._to_string(seq.tokens[seq.prefix_offset : seq.read_offset])
        full = self._to_string(seq.tokens[seq.prefix_offset :])
        if len(full) <= len(prefix) or (hold_incomplete and full.endswith(_INCOMPLETE)):
            return ""
        delta = full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(seq.tokens)
        seq.output_text += delta
        return delta
