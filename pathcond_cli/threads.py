"""How many threads torch computes with: the CPUs this process may use, unless told.

torch starts one thread per core of the machine, whatever share of it the process was given:
on a busy node, or with several pathcond processes side by side (``xargs -P``, a Slurm job
per core group), those threads fight over the same cores, and the same command ran 3–4×
slower than with one thread (0.5.0).

Under an address-space limit (``ulimit -v``) each thread counts with its stacks and malloc arena,
touched or not, and OpenMP ends the process (exit 1, "libgomp: Thread creation failed") when one
cannot be created: no more threads are started than fit in a share of the address space left,
and they are started at once, before the data take the rest.
"""

from __future__ import annotations

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
# Share of the address space left that torch's threads may take under a limit; the rest is the data's.
THREADS_ADDRESS_SHARE = 0.25
# glibc reserves this much address space for the malloc arena of a thread that allocates (64-bit).
MALLOC_ARENA_BYTES = 64 << 20
# A thread's stack when RLIMIT_STACK is unlimited (glibc's default on x86-64).
UNLIMITED_STACK_DEFAULT_BYTES = 2 << 20
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
    :func:`threads_that_fit`) and return it.

    The intra-op threads follow each call, and are started at once; the inter-op pool, which
    torch lets a process size only once and before any parallel work, is sized on the first call
    if torch still allows it. A ``count`` beyond what fits in the address space left under the
    process's limit is refused (InputError): starting them would end the process.
    """
    global _interop_set
    fitting = threads_that_fit()
    if count is None:
        count = available_cpus() if fitting is None else min(available_cpus(), fitting)
    elif isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"threads: {count!r} is not a positive number of threads")
    elif fitting is not None and count > fitting:
        raise InputError(
            f"threads: {count} threads do not fit in this process's address-space limit (ulimit -v): torch's "
            f"threads may take {THREADS_ADDRESS_SHARE:.0%} of the {address_space_left() / 2**30:.3g} GiB left (the "
            f"rest is the network's), and each takes about {thread_address_space() / 2**20:.0f} MiB (its stacks and "
            f"malloc arena); pass --threads {fitting} or fewer, or raise the limit."
        )
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


def threads_that_fit() -> int | None:
    """The most threads whose address space (:func:`thread_address_space`) fits in
    :data:`THREADS_ADDRESS_SHARE` of what is left under the process's address-space limit;
    None without a limit."""
    left = address_space_left()
    if left is None:
        return None
    return 1 + int(left * THREADS_ADDRESS_SHARE) // thread_address_space()


def thread_address_space() -> int:
    """The address space one more of torch's threads takes: a thread of its own pool, one of
    OpenMP's (``OMP_STACKSIZE``, by default the stack size of any thread: RLIMIT_STACK), and the
    malloc arena of a thread that allocates."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = UNLIMITED_STACK_DEFAULT_BYTES if stack == resource.RLIM_INFINITY else stack
    return stack + (_openmp_stack_size() or stack) + MALLOC_ARENA_BYTES


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
