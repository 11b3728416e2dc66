"""Cross-attention probabilities that a prefill asked for (SamplingParams.cross_attention_heads).

Whisper's word timestamps align the text to the audio through a few
"alignment heads" of the decoder's cross-attention (openai-whisper's
`find_alignment`, HF's `return_token_timestamps`). The engine's attention
kernels never form these probabilities, so during such a prefill each
cross-attention layer hands its queries here, and the keys are read back from
the cross cache, which holds every encoder position by then (stored this
step, or cached). Only the asked-for heads are computed, for the asking
sequences only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from encdec_engine.quantization.kv_int8 import read_rows


@dataclass
class CaptureRequest:
    """One prefill sequence's ask: its queries [query_start, query_end) in the flat batch attend
    to the encoder positions stored at `key_slots` of the cross cache."""

    heads: dict[int, list[int]]  # decoder layer -> heads
    query_start: int
    query_end: int
    key_slots: torch.Tensor  # [encoder positions] int64 cache slots
    probs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, head) -> [queries, keys]


@dataclass
class CrossCapture:
    requests: list[CaptureRequest]

    def record(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> None:
        """query: [num_tokens, num_heads * head_dim] as the attention saw it (scaled by `scale` inside)."""
        _, _, _, num_heads, width = kv_cache.shape
        head_dim = query.shape[-1] // num_heads
        keys = kv_cache[0].view(-1, num_heads, width)
        for req in self.requests:
            heads = req.heads.get(layer)
            if not heads:
                continue
            q = query[req.query_start : req.query_end].view(-1, num_heads, head_dim)[:, heads].float()
            k = read_rows(keys.index_select(0, req.key_slots)[:, heads], head_dim, torch.float32)
            probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * scale, dim=-1)
            for head, p in zip(heads, probs):
                req.probs[(layer, head)] = p

    def result(self, req: CaptureRequest, pairs: list[tuple[int, int]]) -> torch.Tensor:
        """[len(pairs), queries, keys] on the CPU, in the order asked."""
        return torch.stack([req.probs[(layer, head)] for layer, head in pairs]).cpu()
