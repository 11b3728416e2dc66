"""Attention backends, one code path over the views each; engine/loader.py picks one per device for the models.

    base.py                AttentionBackend (what every backend implements) and store_kv
    torch_sdpa.py          the CPU (and fallback) backend on torch's scaled_dot_product_attention
    cpu_copies.py          head-major fp32 copies of the contexts the CPU backend reads decode attention from
    xformers_backend.py    the CUDA backend: xformers flash attention for prefill, Triton for decode and stores
    xformers_masks.py      the xformers attention bias of each prefill view (BlockDiagonalMask, ...)
"""
