"""Decode steps over fixed-size batches, replayed from CUDA graphs.

A decode step runs one token per sequence through every layer: hundreds of
small kernels whose launch cost, at small batch sizes, exceeds their run time.
A CUDA graph records the launches of one forward pass once and replays them
with a single call. The recorded kernels read fixed addresses and fixed shapes,
so every step goes through static buffers sized for the largest batch::

    input_ids, positions    [B]       the new token of each sequence
    slot_mapping            [B]       where its self K/V is stored
    seq_lens, block_tables  [B], [B, max_blocks]              self cache
    encoder_lens, cross_block_tables  [B], [B, max_cross_blocks]  cross cache

A step with n sequences copies its arrays into rows [0, n) and runs the graph
of the smallest captured batch size b >= n. Rows [n, b) are padding that
touches nothing: slot -1 (the store kernel skips it) and key length 0 (the
decode kernel reads no key and writes zeros). Block-table columns past a
sequence's length are never read, so they need no clearing. The paged decode
kernel is called with `max_key_len` = the tables' capacity, which fixes its
partition count: the grid depends on b alone. A step whose batch or block
tables exceed the captured sizes runs eagerly (`fits`).

Only backends whose decode takes no host-side decisions from the batch can be
captured (`supports_cuda_graphs`): the xformers backend (Triton store and
paged decode). Without `capture()` the same padded forward runs eagerly; the
CPU tests check it under the Triton interpreter.
"""

from __future__ import annotations

import numpy as np
import torch

from encdec_engine.attention.metadata import AttentionMetadata, AttentionView
from encdec_engine.worker.input_prep import DecodeBatch

MAX_GRAPH_BATCH_SIZE = 256  # larger decode batches run eagerly: launches are amortized there
# Keys a captured step reads at most, per cache: the tables' capacity sets the decode kernel's
# partition count, so a 128k-position model would launch mostly empty partitions. Steps with a
# longer sequence run eagerly (vLLM's max_seq_len_to_capture).
MAX_GRAPH_CONTEXT = 8192


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to min(max_num_seqs, 256), which is always included."""
    largest = min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)
    steps = [1, 2, 4, 8, *range(16, MAX_GRAPH_BATCH_SIZE + 1, 16)]
    return [s for s in steps if s < largest] + [largest]


class DecodeGraphs:
    def __init__(
        self,
        model,
        backend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        batch_sizes: list[int],
        max_blocks: int,  # self-cache blocks of the longest decoder sequence
        max_cross_blocks: int | None,  # cross-cache blocks of the longest encoder input; None: no encoder
        device: torch.device,
    ) -> None:
        if not getattr(backend, "supports_cuda_graphs", False):
            raise ValueError(f"the {backend.name} attention backend cannot run decode from CUDA graphs")
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size = block_size
        self.batch_sizes = sorted(set(batch_sizes))
        self.device = device
        largest = self.batch_sizes[-1]

        def buffer(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        self.input_ids = buffer(largest)
        self.positions = buffer(largest)
        self.slot_mapping = buffer(largest, fill=-1)
        self.seq_lens = buffer(largest)
        self.block_tables = buffer(largest, max_blocks)
        self.has_encoder = max_cross_blocks is not None
        if self.has_encoder:
            self.encoder_lens = buffer(largest)
            self.cross_block_tables = buffer(largest, max_cross_blocks)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int64, device=device)
        self.metadata = {b: self._metadata(b) for b in self.batch_sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # b -> (graph, its output)

    def _metadata(self, b: int) -> AttentionMetadata:
        def view(key_lens: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor | None, causal: bool):
            return AttentionView(
                query_start_loc=self.query_start_loc[: b + 1], key_lens=key_lens[:b], causal=causal,
                max_query_len=1, max_key_len=tables.shape[1] * self.block_size,
                slot_mapping=None if slots is None else slots[:b], block_tables=tables[:b],
            )

        metadata = AttentionMetadata(decoder=view(self.seq_lens, self.block_tables, self.slot_mapping, True),
                                     block_size=self.block_size)
        if self.has_encoder:
            metadata.cross = view(self.encoder_lens, self.cross_block_tables, None, False)
        self.backend.plan(metadata)
        return metadata

    def batch_size_for(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds `num_seqs` sequences (None: run eagerly)."""
        return next((b for b in self.batch_sizes if b >= num_seqs), None)

    def fits(self, batch: DecodeBatch) -> bool:
        """Whether the static buffers hold this step: its sequences and its block tables."""
        return self._misfit(batch) is None

    def _misfit(self, batch: DecodeBatch) -> str | None:
        """Why the static buffers cannot hold this step (None: they can)."""
        if batch.num_seqs > self.batch_sizes[-1]:
            return f"{batch.num_seqs} sequences exceed the largest graph batch size {self.batch_sizes[-1]}"
        tables = [("self", batch.block_tables, self.block_tables)]
        if self.has_encoder:
            tables.append(("cross", batch.cross_block_tables, self.cross_block_tables))
        for name, table, buffer in tables:
            if table.shape[1] > buffer.shape[1]:
                return (f"a {name} block table of {table.shape[1]} blocks exceeds the graph capacity of "
                        f"{buffer.shape[1]} blocks")
        return None

    @torch.inference_mode()
    def capture(self) -> int:
        """Record one graph per batch size, largest first, all in one memory pool; returns
        the device memory the capture took.

        The buffers hold padding only (every row skipped), so the warm-up and
        captured passes store nothing in the KV cache."""
        with torch.cuda.device(self.device):
            reserved = torch.cuda.memory_reserved()
            side = torch.cuda.Stream()
            pool = None
            for b in reversed(self.batch_sizes):
                # Warm-up outside the capture, on the capture's stream: Triton compiles, cuBLAS
                # makes its handles and picks its kernels.
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._forward(b)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side):
                    out = self._forward(b)
                pool = graph.pool()
                self.graphs[b] = (graph, out)
            torch.cuda.synchronize()
            return torch.cuda.memory_reserved() - reserved

    def run(self, batch: DecodeBatch) -> torch.Tensor:  # [n, hidden] of the n sequences
        misfit = self._misfit(batch)
        if misfit is not None:
            raise ValueError(misfit)
        n = batch.num_seqs
        b = self.batch_size_for(n)
        self._load(batch, n, b)
        if b in self.graphs:
            graph, out = self.graphs[b]
            graph.replay()
        else:  # not captured (use_decode_graphs(capture=False): the CPU tests of this padded path)
            out = self._forward(b)
        return out[:n]

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self.metadata[b], None)

    def _load(self, batch: DecodeBatch, n: int, b: int) -> None:
        """Rows [0, n) from the batch; rows [n, b) padding that stores and reads nothing."""
        self._copy_rows(self.input_ids, batch.input_ids, n, b, 0)
        self._copy_rows(self.positions, batch.positions, n, b, 0)
        self._copy_rows(self.slot_mapping, batch.slot_mapping, n, b, -1)
        self._copy_rows(self.seq_lens, batch.seq_lens, n, b, 0)
        self._copy_table(self.block_tables, batch.block_tables)
        if self.has_encoder:
            self._copy_rows(self.encoder_lens, batch.encoder_lens, n, b, 0)
            self._copy_table(self.cross_block_tables, batch.cross_block_tables)

    def _copy_rows(self, buffer: torch.Tensor, values: np.ndarray, n: int, b: int, pad: int) -> None:
        buffer[:n].copy_(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)), non_blocking=True)
        buffer[n:b].fill_(pad)

    def _copy_table(self, buffer: torch.Tensor, table: np.ndarray) -> None:
        n, width = table.shape  # width <= the buffer's: run() checked (_misfit)
        buffer[:n, :width].copy_(torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64)), non_blocking=True)
