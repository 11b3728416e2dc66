"""The paged KV pool: one tensor per decoder layer, shared by self and cross attention.

    kv_caches[layer]: [2 (k, v), num_blocks + 1, block_size, num_kv_heads, row_width]

row_width is head_dim, or for an int8 cache the int8 values and their scales
(quantization/kv_int8.py), so every block move carries the scales with the values.

Block 0 is the padding block (zero, never handed out). The optional swap pool
has the same layout in CPU memory; the cache engine carries out the block
moves and copy-on-write copies the scheduler asks for before each step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from encdec_engine.quantization.kv_int8 import row_width
from encdec_engine.models.interface import KVCacheSpec


def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes one block holds across all decoder layers (int8: values and their scales)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * row_width(spec.head_dim, dtype) * elem


class CacheEngine:
    def __init__(
        self,
        spec: KVCacheSpec,
        block_size: int,
        num_device_blocks: int,
        num_swap_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        width = row_width(spec.head_dim, dtype)  # head_dim, or an int8 row's values + scales
        shape = (2, num_device_blocks + 1, block_size, spec.num_kv_heads, width)
        # torch.empty leaves untouched pages uncommitted; only the padding block must be zero.
        self.kv_caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        for cache in self.kv_caches:
            cache[:, 0].zero_()
        swap_shape = (2, num_swap_blocks, block_size, spec.num_kv_heads, width)
        pin = device.type == "cuda"
        # Called with the device blocks a swap-in or copy-on-write overwrites (a backend that keeps
        # derived copies of cached contexts drops theirs).
        self.write_listeners: list[Callable[[list[int]], None]] = []
        self.swap_caches = (
            [torch.empty(swap_shape, dtype=dtype, pin_memory=pin) for _ in range(spec.num_layers)]
            if num_swap_blocks
            else []
        )

    def _written(self, blocks: list[int]) -> None:
        if blocks:
            for listener in self.write_listeners:
                listener(blocks)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to swap blocks ((device id, swap id) pairs; a device block may go to several)."""
        self._move(self.kv_caches, self.swap_caches, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy swap blocks back to device blocks ((swap id, device id) pairs)."""
        self._move(self.swap_caches, self.kv_caches, pairs)
        self._written([d for _, d in pairs])

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate device blocks (src -> dst) in every layer."""
        if not pairs:
            return
        self._written([d for _, d in pairs])
        src = torch.tensor([s for s, _ in pairs], device=self.kv_caches[0].device)
        dst = torch.tensor([d for _, d in pairs], device=self.kv_caches[0].device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    @staticmethod
    def _move(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src_ids = torch.tensor([s for s, _ in pairs])
        dst_ids = torch.tensor([d for _, d in pairs])
        for src, dst in zip(src_caches, dst_caches):
            dst[:, dst_ids.to(dst.device)] = src[:, src_ids.to(src.device)].to(dst.device)
