"""One temperature fallback schedule (speech/options.py) for the Python API, the CLI and the server; it was
built twice (the CLI rounding to 6 places, the server with numpy to 2) and could disagree."""

import numpy as np
import pytest

from encdec_engine.cli.main import build_parser
from encdec_engine.cli.transcribe_args import temperatures
from encdec_engine.server import audio
from encdec_engine.speech.options import TranscribeOptions, fallback_temperatures


@pytest.mark.parametrize("start", [0.0, 0.1, 0.15, 0.333, 0.5, 0.99, 1.0])
def test_the_cli_the_server_and_the_api_use_one_schedule(start):
    want = tuple(np.arange(start, 1.0 + 1e-6, 0.2))  # openai-whisper's cli()
    args = build_parser().parse_args(["transcribe", "a.wav", "--temperature", str(start)])
    assert temperatures(args) == fallback_temperatures(start) == pytest.approx(want, abs=1e-9)
    assert audio.fallback_temperatures is fallback_temperatures  # the server's `temperature` field
    assert TranscribeOptions().temperatures == fallback_temperatures() == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@pytest.mark.parametrize("start,increment,message", [(-0.1, 0.2, "temperature must be 0 or more"),
                                                     (0.0, 0.0, "increment must be above 0"),
                                                     (float("nan"), 0.2, "temperature must be 0 or more")])
def test_a_bad_schedule_is_refused(start, increment, message):
    with pytest.raises(ValueError, match=message):
        fallback_temperatures(start, increment)
