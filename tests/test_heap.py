"""Heap trimming between steps (tmrun/heap.py): when it trims, that glibc really gives pages back,
and that the runtime trims after committed steps only."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tmrun.groups import SandboxGroup
from tmrun.heap import DEFAULT_EVERY, HeapTrim, _glibc_trim
from tmrun.runtime import Identity, Run

pytestmark = pytest.mark.timeout(60)


def test_trims_on_every_nth_committed_step_only():
    calls: list[int] = []
    heap = HeapTrim(3, trim=lambda pad: calls.append(pad) or 1)
    trimmed = [step for step in range(1, 10) if heap.after_step(step)]
    assert trimmed == [3, 6, 9]
    assert calls == [0, 0, 0] and heap.trims == 3


def test_zero_turns_it_off():
    heap = HeapTrim(0, trim=lambda pad: pytest.fail("trimmed although off"))
    assert not heap.active
    assert not any(heap.after_step(step) for step in range(1, 200))


@pytest.mark.parametrize("text, every", [("7", 7), ("0", 0), (" 12 ", 12)])
def test_from_env(text, every):
    assert HeapTrim.from_env({"TMRUN_MALLOC_TRIM_EVERY": text}).every == every


def test_default_and_a_bad_value_warn_once_and_keep_the_default(caplog):
    assert HeapTrim.from_env({}).every == DEFAULT_EVERY
    for bad in ("-1", "ten", "²", "1e3"):
        caplog.clear()
        assert HeapTrim.from_env({"TMRUN_MALLOC_TRIM_EVERY": bad}).every == DEFAULT_EVERY
        assert len(caplog.records) == 1 and "TMRUN_MALLOC_TRIM_EVERY" in caplog.records[0].getMessage()


def test_the_runtime_trims_after_committed_steps():
    trimmed_at: list[int] = []
    run = Run(Identity(0, 1, role="active"), SandboxGroup(0, 1),
              heap=HeapTrim(4, trim=lambda pad: trimmed_at.append(run.step) or 1))
    for _ in run.steps(total=10):
        assert run.commit()
    assert trimmed_at == [4, 8]


@pytest.mark.skipif(_glibc_trim() is None, reason="malloc_trim is glibc's")
def test_glibc_gives_the_free_pages_of_a_pinned_heap_back():
    """Free 200 MiB of small blocks below a live one at the heap's top: glibc cannot shrink the heap
    by itself (the top is in use), so the pages stay resident until the trim returns them."""
    probe = textwrap.dedent("""
        import ctypes, os
        from tmrun.heap import HeapTrim
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        page = os.sysconf("SC_PAGE_SIZE")
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page >> 20
        size = 64 << 10  # under glibc's mmap threshold: from the main heap
        blocks = [libc.malloc(size) for _ in range(3200)]
        for block in blocks:
            ctypes.memset(block, 1, size)
        pin = libc.malloc(size)
        ctypes.memset(pin, 1, size)
        for block in blocks:
            libc.free(block)
        before = rss()
        heap = HeapTrim(1)
        assert heap.after_step(1)
        print(before, rss())
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True)
    before, after = map(int, out.stdout.split())
    assert before - after >= 150, (before, after)
