"""The two worked examples of DESIGN §2, with their exact numbers."""

import numpy as np

from encdec_engine.worker.input_prep import cumsum_and_arange, pad_rows, prepare_token_arrays


def test_block_size_2_example():
    # Scheduled {0: 3, 1: 2, 2: 5}; block rows [1, 2], [3], [4, 5, 6]; max_model_len 12 -> K = 6.
    block_table = np.zeros((4, 6), dtype=np.int64)
    block_table[0, :2] = [1, 2]
    block_table[1, :1] = [3]
    block_table[2, :3] = [4, 5, 6]
    token_ids = np.arange(4 * 12).reshape(4, 12) + 1000
    a = prepare_token_arrays(np.array([3, 2, 5]), np.array([0, 0, 0]), block_table, 2, token_ids)
    assert a.req_indices.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert a.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert a.query_start_loc.tolist() == [0, 3, 5, 10]
    assert a.block_table_indices.tolist() == [0, 0, 1, 6, 6, 12, 12, 13, 13, 14]
    assert a.block_offsets.tolist() == [0, 1, 0, 0, 1, 0, 1, 0, 1, 0]
    assert a.slot_mapping.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert a.seq_lens.tolist() == [3, 2, 5]
    assert a.token_indices.tolist() == [0, 1, 2, 12, 13, 24, 25, 26, 27, 28]
    assert a.input_ids.tolist() == (token_ids.reshape(-1)[a.token_indices]).tolist()


def test_block_size_16_five_request_example():
    # Requests 0 and 1 decode (54 and 145 computed), 2..4 prefill 93, 75 and 30 tokens.
    num_scheduled = np.array([1, 1, 93, 75, 30])
    num_computed = np.array([54, 145, 0, 0, 0])
    blocks = [list(range(1, 5)), list(range(5, 15)), list(range(15, 21)), list(range(21, 26)), [26, 27]]
    block_table = pad_rows(blocks, width=15)
    a = prepare_token_arrays(num_scheduled, num_computed, block_table, 16)
    cu, arange = cumsum_and_arange(num_scheduled)
    assert cu.tolist() == [1, 2, 95, 170, 200]
    assert arange[:5].tolist() == [0, 0, 0, 1, 2]
    assert a.query_start_loc.tolist() == [0, 1, 2, 95, 170, 200]
    assert a.positions[:4].tolist() == [54, 145, 0, 1]
    assert a.block_table_indices[:3].tolist() == [3, 24, 30]
    assert a.block_table_indices[-1] == 61
    slots = a.slot_mapping.tolist()
    assert slots[:4] == [70, 225, 240, 241]
    assert slots[94] == 332 and slots[95:97] == [336, 337] and slots[169] == 410
    assert slots[170:172] == [416, 417] and slots[-1] == 445
    assert slots[2:95] == list(range(240, 333))
    assert slots[170:] == list(range(416, 446))
    assert a.seq_lens.tolist() == [55, 146, 93, 75, 30]
    assert a.max_query_len == 93
