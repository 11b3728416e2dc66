"""The engine: requests in, one scheduler step at a time, RequestOutputs out; used by llm.py, speech/ and server/.

    llm_engine.py          LLMEngine: add_request, step, abort_request; the loop of scheduler, runner and outputs
    async_engine.py        AsyncLLMEngine: LLMEngine stepped by one thread, outputs streamed to coroutines
    sequence_group.py      a request as the engine holds it: its Sequences and their SequenceGroup
    scheduler.py           continuous batching: waiting / running / swapped queues, budgets, preemption
    block_manager.py       paged KV block accounting: self tables per sequence, cross tables per request,
                           prefix caching
    output_processor.py    a step's results applied request by request, RequestOutputs built
    beam_search.py         beam search with Hugging Face generate(num_beams=...) semantics
    detokenizer.py         incremental detokenization
    loader.py              loading a checkpoint: config, tokenizer, generation config, weights, backend
"""
