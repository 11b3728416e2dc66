"""xformers attention biases describing each prefill view.

encoder self-attention  -> BlockDiagonalMask over encoder lengths (non-causal, square blocks)
decoder self-attention  -> BlockDiagonalCausalMask over decoder lengths, or the
                           bottom-right causal variant when a prefix is already cached
cross-attention         -> BlockDiagonalMask(decoder lengths, encoder lengths) (rectangular blocks)

The classes import and `materialize()` on CPU, so tests check the torch
backend against exactly these masks; the CUDA backend hands them to
`memory_efficient_attention`.
"""

from __future__ import annotations

from encdec_engine.attention.metadata import AttentionView


def prefill_attn_bias(view: AttentionView):
    from xformers.ops.fmha.attn_bias import (
        BlockDiagonalCausalFromBottomRightMask,
        BlockDiagonalCausalMask,
        BlockDiagonalMask,
    )

    q_loc = view.query_start_loc_list
    q_lens = [q_loc[i + 1] - q_loc[i] for i in range(len(q_loc) - 1)]
    k_lens = view.key_lens_list
    if not view.causal:
        return BlockDiagonalMask.from_seqlens(q_seqlen=q_lens, kv_seqlen=k_lens)
    if q_lens == k_lens:
        return BlockDiagonalCausalMask.from_seqlens(q_lens)
    return BlockDiagonalCausalFromBottomRightMask.from_seqlens(q_seqlen=q_lens, kv_seqlen=k_lens)
