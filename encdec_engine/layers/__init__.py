"""The building blocks models and the runner share: sampling, logits processors, linears, norms, activations, RoPE.

    sampler.py              logits -> one token per row: processors, then greedy or seeded sampling
    logits_processors.py    logits processors with Hugging Face semantics, in HF's order
    sampling_state.py       a request's sampler state, built once when it is added
    linear.py               CPU fp32 linears through oneDNN (weights packed once), the vocab head
    activation.py           activations by their Hugging Face config names
    norms.py                normalization layers by their Hugging Face names (RMSNorm, ...)
    rotary.py               rotary position embeddings (RoPE), as Hugging Face computes them
"""
