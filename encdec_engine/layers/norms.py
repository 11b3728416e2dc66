"""Normalization layers by their Hugging Face names."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm and T5LayerNorm (one op sequence): no mean subtracted, no bias; normalize in
    float32, scale in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(hidden.dtype)
