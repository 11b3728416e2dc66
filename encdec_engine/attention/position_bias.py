"""An additive per-head attention bias that depends on the relative position of key and query.

T5's bucketed relative position bias and ALiBi's linear slopes are both a function of
`key position - query position` and the head, so one input serves both: a table of that function
over a window of relative positions, clamped at its ends::

    scores[h, j, p] += table[h, clamp(p - pos_j - min_relative, 0, num_relative - 1)]

    relative position   min_relative ... -1   0   1 ... min_relative + num_relative - 1
    table column        0                               num_relative - 1
                        |<- keys before the query ->|<- after (non-causal views) ->|

Positions are those of the view's sequences: key p of a sequence is at position p, and its q
queries are its last q keys (query j at key_len - q + j), prefill or decode, fresh or cached. The
table is built once per stack and step (T5: an embedding row per bucket, HF's bucketing; ALiBi:
slope x distance) and every layer of the stack gets the same object; backends materialize it per
sequence shape or per padded batch, never over the whole flat batch (see
`attention/backends/torch_sdpa.py`), and the Triton decode kernel reads the table itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class PositionBias:
    table: torch.Tensor  # [num_heads, num_relative] additive bias per head and relative position
    min_relative: int  # the relative position (key - query) of column 0; positions outside are clamped

    @property
    def num_heads(self) -> int:
        return self.table.shape[0]

    def gather(self, relative: torch.Tensor) -> torch.Tensor:
        """relative: [...] key - query positions -> [num_heads, ...] biases."""
        index = (relative - self.min_relative).clamp_(0, self.table.shape[1] - 1)
        return self.table[:, index.reshape(-1)].view(self.num_heads, *relative.shape)

    def block(self, query_len: int, key_len: int, device: torch.device | None = None) -> torch.Tensor:
        """[num_heads, query_len, key_len] biases of a sequence whose queries are its last query_len keys."""
        device = device or self.table.device
        keys = torch.arange(key_len, device=device)
        queries = torch.arange(key_len - query_len, key_len, device=device)
        return self.gather(keys[None, :] - queries[:, None])

    def additive_mask(self, query_len: int, key_len: int, causal: bool, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """[num_heads, query_len, key_len] attention mask of one sequence shape: the bias, and -inf past each
        query when causal."""
        mask = self.block(query_len, key_len, device).to(dtype)
        if causal:
            keys = torch.arange(key_len, device=device)
            queries = torch.arange(key_len - query_len, key_len, device=device)
            mask = mask.masked_fill(keys[None, :] > queries[:, None], float("-inf"))
        return mask

    def padded_mask(self, query_positions: torch.Tensor, key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The mask of a padded batch: query_positions [n, max_q] over keys 0 .. max_key - 1, the bias where
        key_mask [n, 1, max_q, max_key] attends and -inf elsewhere -> [n, num_heads, max_q, max_key]."""
        keys = torch.arange(key_mask.shape[-1], device=query_positions.device)
        values = self.gather(keys[None, None, :] - query_positions[:, :, None]).transpose(0, 1)
        return values.to(dtype).masked_fill(~key_mask, float("-inf"))


# -- T5 ----------------------------------------------------------------------------------------------------

def t5_relative_buckets(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                        max_distance: int) -> torch.Tensor:
    """HF's T5Attention._relative_position_bucket, op for op (the bucket edges are float32 logs)."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).to(torch.long) * num_buckets
        relative = torch.abs(relative)
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    max_exact = num_buckets // 2
    is_small = relative < max_exact
    if_large = max_exact + (torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact)).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return buckets + torch.where(is_small, relative, if_large)


def t5_bucket_index(bidirectional: bool, num_buckets: int, max_distance: int) -> tuple[torch.Tensor, int]:
    """The bucket of every relative position in [-max_distance, max_distance], and that window's first
    position. Every position beyond falls in the last bucket of its side, so clamping to the window is
    exact."""
    relative = torch.arange(-max_distance, max_distance + 1, dtype=torch.long)
    return t5_relative_buckets(relative, bidirectional, num_buckets, max_distance), -max_distance


def t5_position_bias(weight: torch.Tensor, bucket_index: torch.Tensor, min_relative: int) -> PositionBias:
    """weight: [num_buckets, num_heads] (T5's relative_attention_bias embedding) -> the stack's bias."""
    return PositionBias(weight.index_select(0, bucket_index).t().contiguous(), min_relative)


# -- ALiBi -------------------------------------------------------------------------------------------------

def alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] ALiBi slopes (Press et al.; BLOOM's and MPT's choice for head counts not a power of 2)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, max_len: int) -> PositionBias:
    """ALiBi as a position bias: slope_h * (key - query), over sequences of up to max_len positions
    (the seed operator's `is_alibi`). Causal views see only keys <= query, i.e. -slope * distance."""
    relative = torch.arange(-(max_len - 1), max_len, dtype=torch.float32)
    return PositionBias(slopes[:, None].float() * relative[None, :], -(max_len - 1))
