"""Int8 storage for the CPU linears and the KV cache; used by machine/cpu_kernels.py, attention/ and worker/.

    int8_weights.py    CPU linears on int8 weights, one scale per output channel (quantization="int8")
    kv_int8.py         the int8 KV cache (kv_cache_dtype="int8"): per-group scales inside each row
"""
