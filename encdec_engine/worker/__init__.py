"""The model runner and what it needs to run a step on the device; used by engine/.

    model_runner.py     scheduled groups -> flat model inputs and AttentionMetadata; runs the model, samples
    input_prep.py       the token-level arrays of a step, vectorized (numpy)
    step_input.py       SequenceGroupMetadata: what the runner sees of one scheduled request
    step_output.py      StepOutput, RowOutput: a result per row, applied by the engine
    cache_engine.py     the paged KV pool (and swap pool), block moves and copy-on-write copies
    kv_sizing.py        how many KV blocks fit on the device, and what the pool holds
    cuda_graphs.py      decode steps over fixed-size batches, replayed from CUDA graphs
"""
