"""Live transcription, a stream transcribed while it is spoken; for LLM.transcribe_live, the CLI and the server.

    options.py          LiveOptions: turn detection (server_vad or none) and the streaming policy
    session.py          one stream: audio, turns, and the next engine request; engine-independent
    turn.py             one turn: its audio buffer, the words confirmed so far, the next decode
    vad.py              turn detection: Silero VAD frame by frame, OpenAI's server_vad rules
    agreement.py        LocalAgreement: words confirmed once successive hypotheses agree
    model.py            what a session needs of the loaded Whisper checkpoint (tokens, tokenizer, decoding)
    events.py           what a session tells its caller: turns started, stopped, committed, text deltas
    sync_driver.py      a session through LLMEngine.step (LLM.transcribe_live, encdec transcribe --live)
    async_driver.py     a session through AsyncLLMEngine (the server's /v1/realtime)
"""
