"""Long bidirectional attention of one sequence through oneDNN matmuls (CPU): Whisper's encoder.

torch's CPU flash attention multiplies its blocks with MKL's sgemm, and MKL keeps AMD CPUs on its
AVX2 kernels (the reason the fp32 linears are packed for oneDNN, layers/linear.py). Here each head's
keys are a linear's weight: a block of queries times them is one oneDNN matmul (AVX-512), the
softmax runs in place over that block of scores, and the probabilities times the head's transposed
values is a second matmul. A block of 384 query rows keeps its scores (384 x 1,500 fp32, 2.3 MB)
near the core. `scripts/bench_attention.py` on a 2-core AMD EPYC (Zen 5, AVX-512), ms per call
(operands token-major, as the engine holds them, and cold), against `F.scaled_dot_product_attention`
(the flash kernel torch picks) on the same views:

    heads x positions x head_dim   flash    fp32    bf16 (int8 engines)
    12 x 1,500 x 64 (small)         58.9    26.7    21.7
    20 x 1,500 x 64 (turbo)         97.0    44.0    36.5
     6 x 1,500 x 64 (tiny)          28.9    12.9    10.5
    12 x 512 x 64                    6.7     4.7     4.0
    12 x 256 x 64                    1.7     1.6     1.4

The results differ from flash attention's only in summation order (~4e-7 at these sizes). It
runs where the machine's fp32 linears run on oneDNN (`machine/cpu_kernels.py`: an AVX2-only machine
keeps MKL and flash attention unless oneDNN wins the calibration; on a 2-core AVX2 EPYC (Zen 3) it
won at 2 threads, and this took 48-49 ms at 6 x 1,500 x 64 against flash's 62 ms, 100 against 133 at
12 heads: `bench_attention.py`, 2026-11-29), for at least `MIN_LENGTH`
queries over at least as many keys, without a mask or a position bias. (A decoder prompt's few
queries over a cross context stay on flash attention: for them, the transposed copies of the
keys and values cost more than the matmuls save.)

With `quantization="int8"` (weights and activations already rounded to 8 bits) or a bf16 model, and
where oneDNN multiplies bf16 natively (AVX-512 BF16, AMX), the two matmuls take bf16 operands (queries, keys, the
probabilities, values; sums and the softmax stay fp32): the matmuls run 1.8x faster, the whole
call 1.2x (largest difference from fp64 4e-3 against fp32's 4e-7, in the table's shapes).
"""

from __future__ import annotations

import torch

MIN_LENGTH = 512  # queries and keys; below this the two are about even
QUERY_ROWS = 384  # query rows per matmul: their scores stay near the core


def _matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN (weight: a plain [out, in] tensor)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def amx_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """The same attention through torch's flash kernel in bf16 (bf16 operands, fp32 sums and softmax), for
    CPUs with AMX: there its block products run on the AMX tiles (oneDNN's brgemm), and the scores never
    leave the cache. On a 2-core AMX Xeon (2026-11-28, one-off), 6 x 1,500 x 64 (tiny): 7.1 ms against 24.2 ms
    here in bf16 (22-24 ms; flash in fp32 52 ms), largest difference from fp64 1.4e-3 against 4.6e-3."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0).to(torch.bfloat16) for t in (query, key, value))  # [1, H, len, D]
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    out.copy_(o[0].transpose(0, 1))


def applies(query: torch.Tensor, query_len: int, key_len: int) -> bool:
    return (query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16)
            and min(query_len, key_len) >= MIN_LENGTH)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, out: torch.Tensor,
           dtype: torch.dtype = torch.float32) -> None:
    """out[t, h] = softmax(scale * query[t, h] . key[:, h']) @ value[:, h'] for one sequence, every query
    attending to every key (h' = h // (heads / kv_heads): grouped-query heads share their K/V head).

    query, out: [q_len, heads, head_dim]; key, value: [k_len, kv_heads, head_dim] (token-major, any strides).
    `dtype` bfloat16 multiplies in bf16 (fp32 sums, softmax in fp32): see the module doc.
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    group = heads // kv_heads
    q = (query if scale == 1.0 else query * scale).transpose(0, 1).to(dtype).contiguous()  # [H, q, D]
    k = key.transpose(0, 1).to(dtype).contiguous()  # [Hkv, k, D]: each head's keys as a weight
    v_t = value.transpose(0, 1).to(dtype).contiguous().transpose(1, 2).contiguous()  # [Hkv, D, k] (2.3x one permute)
    for h in range(heads):
        for start in range(0, q.shape[1], QUERY_ROWS):
            scores = _matmul(q[h, start:start + QUERY_ROWS], k[h // group]).float()
            torch.softmax(scores, dim=-1, out=scores)
            out[start:start + QUERY_ROWS, h] = _matmul(scores.to(dtype), v_t[h // group])
