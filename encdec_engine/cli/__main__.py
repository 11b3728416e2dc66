"""`python -m encdec_engine.cli ...` runs the `encdec` command."""

from encdec_engine.cli.main import run

run()
