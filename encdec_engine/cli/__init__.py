"""The `encdec` command line (the console script, and `python -m encdec_engine.cli`); the top of the import layers.

    main.py                          the parser of every subcommand, and running one
    __main__.py                      `python -m encdec_engine.cli`
    args.py                          shared plumbing: value types, help layout, spellings, engine flags
    transcribe.py, transcribe_args.py   `encdec transcribe` (openai-whisper's command line) and its flags
    live.py                          `encdec transcribe --live`: live transcription on the command line
    translate.py                     `encdec translate`: text files translated line by line
    serve.py                         `encdec serve`: its flags, the ServerLimits they set, running the server
    ray.py                           the --ray and --replicas flags, and the commands they run on Ray
"""
