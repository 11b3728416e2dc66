"""Attention kernels that the backends call (attention/backends/): Triton on CUDA, C and oneDNN on the CPU.

    kv_store.py                  Triton: new K/V scattered into the paged cache by slot mapping
    paged_attention.py           Triton: paged decode attention, one query per sequence over its context
    cpu_decode.py, cpu_decode.c  CPU decode attention read straight from the fp32/bf16 pool, through one C
                                 kernel compiled on first use
    onednn_attention.py          long bidirectional attention through oneDNN matmuls (Whisper's encoder, CPU)
"""
