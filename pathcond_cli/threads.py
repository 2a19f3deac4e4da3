"""How many threads torch computes with: the CPUs this process may use, unless told.

torch starts one thread per core of the machine, whatever share of it the process was given:
on a busy node, or with several pathcond processes side by side (``xargs -P``, a Slurm job
per core group), those threads fight over the same cores, and the same command ran 3–4×
slower than with one thread (0.5.0).

Under an address-space limit (``ulimit -v``) every thread counts with its stack, touched or not,
and OpenMP ends the process (exit 1, "libgomp: Thread creation failed") when one cannot be
created. Each thread of the count comes twice (measured on torch 2.13: ``set_num_threads(20)``
starts 19 threads of torch's own pool, and the first parallel operation 19 of OpenMP's), and
glibc gives each new thread that allocates a malloc arena of its own, 64 MiB of address space
(up to 8 per core): 8 threads took 72 MiB each, and under a limit the first threads' arenas
took the room the later threads' stacks needed. So under a limit glibc is told to keep to one
arena (``M_ARENA_MAX``; torch's large tensors are mapped on their own, outside any arena): a
thread then takes its two stacks and what it allocates as it works (measured 16.03 MiB per
thread with 8 MiB stacks, 200 threads under ``ulimit -v 4G``). The threads are started at
once, before the data take the rest.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping

try:
    import resource
except ImportError:  # Windows: no address-space limit (address_space_left is None)
    resource = None

import torch

from .errors import InputError, UsageError
from .io.formats.common import address_space_left

# Environment variables a scheduler or a user sets to give this process its share of the cores.
CPU_LIMIT_VARIABLES = ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS")
# Share of the address space left that the default thread count may take under a limit; the rest
# is the data's. An explicit count is refused only when its threads cannot start at all.
THREADS_ADDRESS_SHARE = 0.25
# glibc reserves this much address space for the malloc arena of a thread that allocates (64-bit).
MALLOC_ARENA_BYTES = 64 << 20
# What a thread allocates as it works, beyond its stacks (measured 0.8 MiB after a matmul and a sort).
THREAD_WORKING_BYTES = 1 << 20
# A thread's stack when RLIMIT_STACK is unlimited (glibc's default on x86-64).
UNLIMITED_STACK_DEFAULT_BYTES = 2 << 20
# mallopt's parameter for the most malloc arenas (glibc's malloc.h).
M_ARENA_MAX = -8
# Elements per thread of the operation that starts the pool (torch splits work in grains of 32768).
POOL_START_ELEMENTS = 1 << 16

_interop_set = False


def available_cpus(environ: Mapping[str, str] | None = None) -> int:
    """The CPUs this process may run on (its affinity), capped by ``SLURM_CPUS_PER_TASK`` and
    ``OMP_NUM_THREADS`` when they hold a positive count (``OMP_NUM_THREADS``' first level when it
    lists several); other values of them are ignored, as OpenMP ignores them."""
    environ = os.environ if environ is None else environ
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on macOS and Windows
        cpus = os.cpu_count() or 1
    for name in CPU_LIMIT_VARIABLES:
        limit = _positive_count(environ.get(name, "").split(",")[0])
        if limit is not None:
            cpus = min(cpus, limit)
    return max(cpus, 1)


def set_threads(count: int | None = None) -> int:
    """Make torch compute with ``count`` threads (default :func:`available_cpus`, within what
    :func:`threads_that_fit` in :data:`THREADS_ADDRESS_SHARE` of the address space left) and
    return it.

    The intra-op threads follow each call, and are started at once; the inter-op pool, which
    torch lets a process size only once and before any parallel work, is sized on the first call
    if torch still allows it. A ``count`` whose threads do not fit in the address space left
    under the process's limit is refused (InputError): starting them would end the process.
    """
    global _interop_set
    if isinstance(count, bool) or not (count is None or isinstance(count, int) and count >= 1):
        raise UsageError(f"threads: {count!r} is not a positive number of threads")
    left = address_space_left()
    if left is not None:
        arenas_capped = _keep_to_one_malloc_arena()
        if count is None:
            count = min(available_cpus(), threads_that_fit(int(left * THREADS_ADDRESS_SHARE), arenas_capped))
        elif count > (fitting := threads_that_fit(left, arenas_capped)):
            raise InputError(
                f"threads: {count} threads do not fit in this process's address-space limit (ulimit -v): "
                f"{left / 2**30:.3g} GiB is left, and each thread takes about "
                f"{thread_address_space(arenas_capped) / 2**20:.0f} MiB (its stacks"
                f"{'' if arenas_capped else ' and malloc arena'}), so OpenMP could not start them; pass "
                f"--threads {fitting} or fewer, or raise the limit."
            )
    elif count is None:
        count = available_cpus()
    torch.set_num_threads(count)
    if not _interop_set:
        _interop_set = True
        try:
            torch.set_num_interop_threads(count)
        except RuntimeError:  # parallel work already ran in this process: torch keeps its pool
            pass
    if count > 1:
        torch.ones(count * POOL_START_ELEMENTS).add_(1)
    return count


def threads_that_fit(room: int, arenas_capped: bool) -> int:
    """The most threads (the calling one and the new ones, each :func:`thread_address_space`) that
    ``room`` bytes of address space hold."""
    return 1 + room // thread_address_space(arenas_capped)


def thread_address_space(arenas_capped: bool) -> int:
    """The address space one more of torch's threads takes: a thread of its own pool (RLIMIT_STACK),
    one of OpenMP's (``OMP_STACKSIZE``, by default RLIMIT_STACK too), what they allocate as they
    work, and, unless glibc keeps to one arena, the malloc arena each gets."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = UNLIMITED_STACK_DEFAULT_BYTES if stack == resource.RLIM_INFINITY else stack
    arena = 0 if arenas_capped else MALLOC_ARENA_BYTES
    return stack + (_openmp_stack_size() or stack) + THREAD_WORKING_BYTES + arena


def _keep_to_one_malloc_arena() -> bool:
    """Tell glibc's malloc to give new threads no arena of their own; False where the C library
    refuses or lacks the setting (not glibc): its threads are then counted with an arena each."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    return mallopt(M_ARENA_MAX, 1) == 1


def _openmp_stack_size() -> int | None:
    """``OMP_STACKSIZE`` in bytes (a size in KiB, or with a B, K, M or G suffix), None when unset or unreadable."""
    found = re.fullmatch(r"\s*(\d+)\s*([bkmgBKMG]?)\s*", os.environ.get("OMP_STACKSIZE", ""))
    if found is None:
        return None
    return int(found[1]) << {"b": 0, "k": 10, "": 10, "m": 20, "g": 30}[found[2].lower()]


def _positive_count(text: str) -> int | None:
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if value > 0 else None
