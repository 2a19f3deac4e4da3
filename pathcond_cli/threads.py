"""How many threads torch computes with: the CPUs this process may use, unless told.

torch starts one thread per core of the machine, whatever share of it the process was given:
on a busy node, or with several pathcond processes side by side (``xargs -P``, a Slurm job
per core group), those threads fight over the same cores, and the same command ran 3–4×
slower than with one thread (0.5.0).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from .errors import UsageError

# Environment variables a scheduler or a user sets to give this process its share of the cores.
CPU_LIMIT_VARIABLES = ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS")

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
    """Make torch compute with ``count`` threads (default :func:`available_cpus`) and return it.

    The intra-op threads follow each call; the inter-op pool, which torch lets a process size
    only once and before any parallel work, is sized on the first call if torch still allows it.
    """
    global _interop_set
    if count is None:
        count = available_cpus()
    elif isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"threads: {count!r} is not a positive number of threads")
    torch.set_num_threads(count)
    if not _interop_set:
        _interop_set = True
        try:
            torch.set_num_interop_threads(count)
        except RuntimeError:  # parallel work already ran in this process: torch keeps its pool
            pass
    return count


def _positive_count(text: str) -> int | None:
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if value > 0 else None
