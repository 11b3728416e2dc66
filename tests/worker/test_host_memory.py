"""Freed memory kept for reuse (glibc malloc), and the switch that leaves malloc alone."""

import platform
import subprocess
import sys

import pytest

from encdec_engine.worker.host_memory import keep_freed_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


@glibc
def test_large_tensors_made_step_after_step_stop_faulting_in_fresh_pages():
    """A 64 MB tensor made, written and freed at every step (as a step's logits are): with freed memory
    kept, later steps write into pages the process already has (once the heap has settled); glibc's
    default maps fresh ones at every allocation, and the kernel faults in (and zeroes) each of their
    16,384 4 KB pages anew.
    Each case in a fresh process: the setting is process-wide."""
    code = """
import resource, sys, torch
from encdec_engine.worker.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():
    torch.empty(16 * 2**20).fill_(1.0)  # 64 MB: above glibc's largest mmap threshold
for _ in range(12):  # glibc's heap settles: the first frees leave holes a same-size request cannot reuse
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    def page_faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip())

    pages = 3 * 64 * 2**20 // 4096
    assert page_faults("keep") < pages // 10
    assert page_faults("system") > pages // 2


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_the_environment_switch_leaves_malloc_as_it_is(monkeypatch, value):
    monkeypatch.setenv("ENCDEC_KEEP_FREED_MEMORY", value)
    assert keep_freed_memory() is False
