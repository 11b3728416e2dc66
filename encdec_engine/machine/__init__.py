"""Tuning to the machine the engine runs on, applied once per process by engine/loader.py and engine/llm_engine.py.

    cpu_kernels.py    which kernel runs the CPU linears (MKL, oneDNN, int8 variants), calibrated per machine
    threads.py        torch's CPU thread pools, set before the model loads
    host_memory.py    freed CPU memory kept by malloc for the next step's tensors
"""
