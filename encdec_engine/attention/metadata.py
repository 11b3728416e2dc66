"""Attention metadata: one view of the flat batch per attention type.

The model runner flattens every scheduled sequence into one token vector (no
padding). Each attention type sees that batch through an `AttentionView`:
which query tokens belong to which sequence, how many keys each sequence
attends to, whether it is causal, where new K/V are stored in the paged cache
and where cached K/V are read from. Backends have a single code path over
views; a decoder-only batch simply has no encoder or cross view.

Lengths, for sequence i of a batch (prefill shown; decode has q_i = 1)::

    decoder tokens  |<-- computed_i -->|<-- q_i (scheduled) -->|
                    |<------------- key_len_i ---------------->|   decoder self: causal,
                                                                    query j sees keys <= computed_i + j
    encoder tokens  |<------------ e_i (encoder_seq_len) ------>|   encoder self: q = k = e_i
    cross           queries: q_i decoder tokens, keys: e_i encoder positions (non-causal)

Flat layout of the query tokens (query_start_loc has num_seqs + 1 entries)::

    [ seq0: q_0 tokens | seq1: q_1 tokens | ... ]
    ^0                 ^query_start_loc[1]      ^query_start_loc[num_seqs] = num_tokens
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from encdec_engine.attention.capture import CrossCapture


class AttentionType(enum.Enum):
    ENCODER = enum.auto()  # encoder self-attention: non-causal, nothing cached
    DECODER = enum.auto()  # decoder self-attention: causal, paged self cache
    ENCODER_DECODER = enum.auto()  # cross-attention: non-causal, paged cross cache


def host_to_device(array, device: torch.device | str) -> torch.Tensor:
    """A host array as a tensor on `device`; on the CPU it shares the array's memory (no copy, no `.to`)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if torch.device(device).type == "cpu" else tensor.to(device, non_blocking=True)


# The AttentionMetadata field each attention type reads.
_VIEW_OF = {AttentionType.DECODER: "decoder", AttentionType.ENCODER: "encoder", AttentionType.ENCODER_DECODER: "cross"}


@dataclass
class AttentionView:
    """How one attention type sees the flat batch.

    Keys come either from the fresh K/V of this step (`block_tables is None`,
    laid out by `key_start_loc`) or from the paged cache through
    `block_tables`. New K/V are written to the cache at `slot_mapping` when it
    is set.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] offsets into the flat queries
    key_lens: torch.Tensor  # [num_seqs] keys each sequence attends to
    causal: bool
    max_query_len: int
    max_key_len: int
    slot_mapping: torch.Tensor | None = None  # [num_new_kv_tokens] cache slot of each new K/V
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] cached K/V to read
    key_start_loc: torch.Tensor | None = None  # [num_seqs + 1] offsets into fresh K/V
    # Host copies for per-sequence loops (avoid device syncs on every use).
    query_start_loc_list: list[int] | None = None
    key_lens_list: list[int] | None = None
    key_start_loc_list: list[int] | None = None
    plan: Any = None  # backend-specific precomputation for this step (see AttentionBackend.plan)
    # Decode self views: each row's sequence id, for a backend that keeps state per sequence across steps.
    seq_ids: list[int] | None = None

    @classmethod
    def from_arrays(cls, query_start_loc, key_lens, causal: bool, device: torch.device | str = "cpu",
                    key_start_loc=None, **tensors) -> AttentionView:
        """Build a view from host arrays (numpy or lists): device tensors plus the host copies
        the per-sequence loops use. `tensors` are slot_mapping and/or block_tables."""
        query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
        key_lens = np.asarray(key_lens, dtype=np.int64)

        def to_device(array) -> torch.Tensor:
            return host_to_device(array, device)

        query_start_loc_list, key_lens_list = query_start_loc.tolist(), key_lens.tolist()
        return cls(
            query_start_loc=to_device(query_start_loc),
            key_lens=to_device(key_lens),
            causal=causal,
            max_query_len=max((b - a for a, b in zip(query_start_loc_list, query_start_loc_list[1:])), default=0),
            max_key_len=max(key_lens_list, default=0),
            key_start_loc=None if key_start_loc is None else to_device(key_start_loc),
            query_start_loc_list=query_start_loc_list,
            key_lens_list=key_lens_list,
            key_start_loc_list=None if key_start_loc is None else np.asarray(key_start_loc).tolist(),
            **{k: None if v is None else to_device(v) for k, v in tensors.items()},
        )

    @property
    def num_seqs(self) -> int:
        return self.key_lens.shape[0]

    @property
    def reads_cache(self) -> bool:
        return self.block_tables is not None


@dataclass
class AttentionMetadata:
    """The views of one forward pass; `encoder` and `cross` are None without an encoder step."""

    decoder: AttentionView
    encoder: AttentionView | None = None
    cross: AttentionView | None = None
    block_size: int = 16
    capture: CrossCapture | None = None  # the capture of a prefill that asked for cross-attention probabilities

    def view(self, attn_type: AttentionType) -> AttentionView:
        view = getattr(self, _VIEW_OF[attn_type])
        if view is None:
            raise RuntimeError(f"no {attn_type.name} attention view in this batch")
        return view
