"""Freed memory kept for reuse (glibc malloc), and the switch that leaves malloc alone."""

import platform
import subprocess
import sys

import pytest

from encdec_engine.machine.host_memory import keep_freed_memory

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
from encdec_engine.machine.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():
    torch.empty(16 * 2**20).fill_(1.0)  # 64 MB: above glibc's largest mmap threshold
for _ in range(12):  # glibc's heap settles: the first frees leave holes a same-size request cannot reuse
    step()
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    def steps_faulting_in_their_tensor(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        pages = 64 * 2**20 // 4096
        return sum(int(faults) > pages // 2 for faults in done.stdout.split())

    # The heap may still move once (an allocation of torch's own between steps can take the hole a
    # tensor was freed into): one step of eight, on CI's machine, faulted its tensor in anew.
    assert steps_faulting_in_their_tensor("keep") <= 2
    assert steps_faulting_in_their_tensor("system") == 8


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_the_environment_switch_leaves_malloc_as_it_is(monkeypatch, value):
    monkeypatch.setenv("ENCDEC_KEEP_FREED_MEMORY", value)
    assert keep_freed_memory() is False
