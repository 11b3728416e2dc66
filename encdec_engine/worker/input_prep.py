"""Vectorized derivation of the token-level arrays of a step (numpy, no per-token loops).

Levels, for R scheduled requests and T scheduled tokens:

- request level [R]: num_scheduled_tokens, num_computed_tokens, seq_lens;
  query_start_loc [R + 1] (a leading 0);
- token level [T]: req_indices, positions, token_indices, input_ids,
  block_table_indices, block_offsets, slot_mapping;
- system level: the token-id table [max_num_reqs, max_model_len] and the
  block table [max_num_reqs, max_blocks_per_req] (block 0 = padding).

    positions = num_computed[req_indices] + arange_within_request
    slot      = block_table.flat[req_indices * K + positions // block_size] * block_size
                + positions % block_size
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenArrays:
    num_scheduled_tokens: np.ndarray  # [R]
    num_computed_tokens: np.ndarray  # [R]
    query_start_loc: np.ndarray  # [R + 1]
    seq_lens: np.ndarray  # [R]
    req_indices: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    token_indices: np.ndarray  # [T] flat indices into the token-id table
    input_ids: np.ndarray | None  # [T]; None without a token table (audio encoders)
    block_table_indices: np.ndarray  # [T] flat indices into the block table
    block_offsets: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]

    @property
    def max_query_len(self) -> int:
        return int(self.num_scheduled_tokens.max(initial=0))


def cumsum_and_arange(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[2, 5, 3] -> cumsum [2, 7, 10], arange [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]."""
    cu = np.cumsum(counts)
    total = int(cu[-1]) if len(cu) else 0
    starts = np.repeat(cu - counts, counts)
    return cu, np.arange(total, dtype=np.int64) - starts


def prepare_token_arrays(
    num_scheduled_tokens: np.ndarray,  # [R]
    num_computed_tokens: np.ndarray,  # [R]
    block_table: np.ndarray,  # [max_num_reqs, max_blocks_per_req]
    block_size: int,
    token_ids: np.ndarray | None = None,  # [max_num_reqs, max_model_len]
) -> TokenArrays:
    num_scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64)
    num_computed = np.asarray(num_computed_tokens, dtype=np.int64)
    cu, arange = cumsum_and_arange(num_scheduled)
    req_indices = np.repeat(np.arange(len(num_scheduled), dtype=np.int64), num_scheduled)
    positions = num_computed[req_indices] + arange

    input_ids, token_indices = None, np.empty(0, dtype=np.int64)
    if token_ids is not None:
        token_indices = positions + req_indices * token_ids.shape[1]
        input_ids = token_ids.reshape(-1)[token_indices]

    block_table_indices = req_indices * block_table.shape[1] + positions // block_size
    block_numbers = block_table.reshape(-1)[block_table_indices].astype(np.int64)
    block_offsets = positions % block_size
    return TokenArrays(
        num_scheduled_tokens=num_scheduled,
        num_computed_tokens=num_computed,
        query_start_loc=np.concatenate([[0], cu]).astype(np.int64),
        seq_lens=num_computed + num_scheduled,
        req_indices=req_indices,
        positions=positions,
        token_indices=token_indices,
        input_ids=input_ids,
        block_table_indices=block_table_indices,
        block_offsets=block_offsets,
        slot_mapping=block_numbers * block_size + block_offsets,
    )


def pad_rows(rows: list[list[int]], width: int | None = None, fill: int = 0) -> np.ndarray:
    """Stack ragged rows into a [len(rows), width] int64 table padded with `fill`."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    table = np.full((len(rows), max(width, 1)), fill, dtype=np.int64)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table


@dataclass
class DecodeBatch:
    """The host arrays of a decode step: one new token per sequence, n sequences."""

    input_ids: np.ndarray  # [n]
    positions: np.ndarray  # [n]
    slot_mapping: np.ndarray  # [n] self-cache slot of each new K/V
    block_tables: np.ndarray  # [n, w] self-cache blocks
    seq_lens: np.ndarray  # [n] self keys, the new token included
    cross_block_tables: np.ndarray | None = None  # [n, wc] cross-cache blocks; None without an encoder
    encoder_lens: np.ndarray | None = None  # [n] cross keys
    seq_ids: list[int] | None = None  # [n] each row's sequence

    @property
    def num_seqs(self) -> int:
        return len(self.input_ids)
