"""Attention for every model: one layer, over a view per attention type; used by models/ and worker/.

    metadata.py        AttentionView (one per attention type) and AttentionMetadata; the length diagram
    layer.py           Attention, the layer every model uses, parameterized by its attention type
    position_bias.py   an additive per-head bias over relative positions (T5's buckets, ALiBi)
    capture.py         cross-attention probabilities a prefill asked for (Whisper's word timestamps)
    backends/          the AttentionBackend interface and its CPU (torch SDPA) and CUDA (xformers) backends
    ops/               the kernels backends call: Triton KV store and paged decode, CPU decode (C), oneDNN
"""
