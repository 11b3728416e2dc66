"""The CUDA-graph decode path's static buffers, on CPU: which batch sizes are captured, how a
step's arrays land in the fixed-size buffers, and what the padding rows hold. The same padded
forward through the real model and Triton kernels is checked against eager decode in
test_triton_kernels.py (interpreter) and, captured, in test_gpu.py."""

import numpy as np
import pytest
import torch

from encdec_engine.attention.backends.torch_sdpa import TorchSDPABackend
from encdec_engine.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from encdec_engine.worker.input_prep import DecodeBatch, pad_rows

BLOCK_SIZE = 4


class GraphSafeBackend:
    name = "stub"
    supports_cuda_graphs = True

    def __init__(self):
        self.planned = []

    def plan(self, metadata):
        self.planned.append(metadata)


class EchoModel:
    """Returns, per row, what the attention layers would see: the row's inputs and view entries."""

    def __call__(self, input_ids, positions, kv_caches, metadata, encoder_hidden):
        assert encoder_hidden is None
        dec, cross = metadata.decoder, metadata.cross
        b = input_ids.shape[0]
        assert dec.key_lens.shape[0] == dec.slot_mapping.shape[0] == dec.block_tables.shape[0] == b
        cols = [input_ids, positions, dec.slot_mapping, dec.key_lens, dec.block_tables[:, 0]]
        if cross is not None:
            cols += [cross.key_lens, cross.block_tables[:, 0]]
        return torch.stack(cols, 1)


def make_graphs(sizes=(1, 2, 4), max_blocks=3, max_cross_blocks=5) -> DecodeGraphs:
    return DecodeGraphs(EchoModel(), GraphSafeBackend(), [], BLOCK_SIZE, list(sizes), max_blocks, max_cross_blocks,
                        torch.device("cpu"))


def decode_batch(n: int, seed: int, encoder: bool = True) -> DecodeBatch:
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(1, 3 * BLOCK_SIZE, n)
    tables = pad_rows([list(rng.integers(1, 50, -(-s // BLOCK_SIZE))) for s in seq_lens])
    positions = seq_lens - 1
    batch = DecodeBatch(input_ids=rng.integers(3, 99, n), positions=positions,
                        slot_mapping=tables[np.arange(n), positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
                        block_tables=tables, seq_lens=seq_lens)
    if encoder:
        batch.encoder_lens = rng.integers(1, 5 * BLOCK_SIZE, n)
        batch.cross_block_tables = pad_rows([list(rng.integers(50, 99, -(-e // BLOCK_SIZE)))
                                             for e in batch.encoder_lens])
    return batch


def test_captured_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = graph_batch_sizes(1000)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 20


def test_views_have_fixed_shapes_and_the_tables_capacity():
    graphs = make_graphs()
    for b, metadata in graphs.metadata.items():
        assert metadata.decoder.num_seqs == metadata.cross.num_seqs == b
        assert metadata.decoder.max_query_len == 1 and metadata.decoder.causal and not metadata.cross.causal
        # The decode kernel's partition count follows max_key_len: fixed at the capacity.
        assert metadata.decoder.max_key_len == 3 * BLOCK_SIZE and metadata.cross.max_key_len == 5 * BLOCK_SIZE
    assert len(graphs.backend.planned) == 3  # planned once per size, not per step


@pytest.mark.parametrize("n, expected_b", [(1, 1), (3, 4), (4, 4)])
def test_a_step_fills_its_rows_and_pads_the_rest(n, expected_b):
    graphs = make_graphs()
    graphs.run(decode_batch(4, seed=0))  # leave real values in every row first
    batch = decode_batch(n, seed=n)
    assert graphs.batch_size_for(n) == expected_b and graphs.fits(batch)
    out = graphs.run(batch)
    assert out.shape[0] == n  # only the real rows come back
    expected = np.stack([batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens,
                         batch.block_tables[:, 0], batch.encoder_lens, batch.cross_block_tables[:, 0]], 1)
    np.testing.assert_array_equal(out.numpy(), expected)
    padded = graphs._forward(expected_b)[n:]  # what the padding rows fed the model
    assert (padded[:, 2] == -1).all(), "padding rows must store nowhere (slot -1)"
    assert (padded[:, 3] == 0).all() and (padded[:, 5] == 0).all(), "padding rows must read no keys"


def test_decoder_only_batches_have_no_cross_view():
    graphs = make_graphs(max_cross_blocks=None)
    assert graphs.metadata[2].cross is None
    out = graphs.run(decode_batch(2, seed=3, encoder=False))
    assert out.shape == (2, 5)


def test_limits_are_errors_that_name_them():
    with pytest.raises(ValueError, match="torch-sdpa attention backend cannot run decode from CUDA graphs"):
        DecodeGraphs(EchoModel(), TorchSDPABackend(BLOCK_SIZE), [], BLOCK_SIZE, [1], 3, None, torch.device("cpu"))
    graphs = make_graphs(max_blocks=2)
    wide = decode_batch(2, seed=1)
    wide.block_tables = pad_rows([[1, 2, 3], [4]])
    assert not graphs.fits(wide) and not graphs.fits(decode_batch(5, seed=2))  # the runner decodes these eagerly
    wide_cross = decode_batch(2, seed=1)
    wide_cross.block_tables = pad_rows([[1], [2]])
    wide_cross.cross_block_tables = pad_rows([[1] * 6, [2]])
    assert not graphs.fits(wide_cross)
    with pytest.raises(ValueError, match="self block table of 3 blocks exceeds the graph capacity of 2"):
        graphs.run(wide)
    assert graphs.batch_size_for(5) is None
    with pytest.raises(ValueError, match="5 sequences exceed the largest graph batch size 4"):
        graphs.run(decode_batch(5, seed=2))
