"""Freed memory goes back to the system after every cycle: what keeps a year-long daemon's RSS flat.

A job allocates a few hundred MB in the daemon's process (its samples decoded, activations, the optimizer's
state, the models scored side by side) and frees it when it ends. PyTorch's CPU tensors come from the C
library's ``malloc`` (no cache of its own on CPU), and glibc keeps most of what a job freed: ``free`` gives
back only the top of the main heap, every thread that allocated (torch's intra-op pool) has an arena of its
own, and once a large block has been freed the threshold above which a block gets a mapping of its own rises
to that size (up to 32 MiB), so later tensors are carved from those heaps instead. The process's RSS then
stays at the high-water mark of its largest job: the soak (``benchmarks/soak.py``) saw it 16 % above the
first month's, following when the last job ran.

``malloc_trim(0)`` walks every arena and hands each wholly free page back to the kernel (``madvise``); on an
idle heap it finds nothing and costs microseconds, after a job a few milliseconds. It is looked up in the
process's own symbols, so where the C library is not glibc (musl, macOS) there is none and nothing is done.
On CUDA, PyTorch's caching allocator keeps freed blocks for reuse: ``torch.cuda.empty_cache()`` gives them
back, when this process has touched CUDA at all. No ``gc.collect()``: with torch loaded a full collection
takes most of a second of CPU, and what a job leaves in reference cycles is collected by the interpreter's
own schedule.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols already loaded: glibc's, where it is the C library
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


MALLOC_TRIM = _malloc_trim()


def give_back() -> None:
    """Return the memory this process has freed to the system: glibc's free pages, and CUDA's cached blocks."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
    torch = sys.modules.get("torch")  # never imported for this: a process without torch holds no tensor
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
