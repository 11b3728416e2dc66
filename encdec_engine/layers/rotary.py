"""Rotary position embeddings (RoPE), computed exactly as Hugging Face does.

The angles are `position * inv_freq` in float32, duplicated over both halves
of the head (the "rotate_half" convention, not interleaved pairs), so that
fp32 outputs match HF bit for bit. The tables are recomputed from the flat
`positions` of each step: [num_tokens, head_dim] is tiny next to attention,
and no buffer is needed (models are built on the meta device).
"""

from __future__ import annotations

import torch


def default_inv_freq(rope_theta: float, rotary_dim: int) -> torch.Tensor:  # [rotary_dim // 2] float32
    """HF's `compute_default_rope_parameters`: 1 / theta^(2i / dim)."""
    return 1.0 / (rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))


class RotaryEmbedding:
    """cos/sin tables for the flat batch; holds no parameters.

    `attention_scaling` multiplies cos and sin (1.0 except for YaRN-like
    scalings, where HF applies it the same way).
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq.float().cpu()  # [head_dim // 2]
        self.attention_scaling = attention_scaling
        # The copy on the positions' device, made on first use: a per-step host-to-device copy
        # would sync every decode step and cannot be captured in a CUDA graph.
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype  # positions: [num_tokens]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_tokens, 1, head_dim]
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv_freq[None, :]  # [num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor  # x: [num_tokens, num_heads, head_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    return (x * cos) + (rotate_half(x) * sin)
