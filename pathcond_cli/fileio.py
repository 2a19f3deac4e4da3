"""Atomic file writes: a temporary file beside the target, fsync, then rename."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import OutputError


def check_destination(destination: Path, *, inputs: list[Path] = (), in_place: bool = False) -> None:
    """Refuse before any work: a missing directory, an unwritable one, or the input itself."""
    directory = destination.parent if str(destination.parent) else Path(".")
    if not directory.is_dir():
        raise OutputError(f"cannot write '{destination}': directory '{directory}' does not exist.")
    if not os.access(directory, os.W_OK):
        raise OutputError(f"cannot write '{destination}': no write permission in directory '{directory}'.")
    if destination.is_dir():
        raise OutputError(f"cannot write '{destination}': it is a directory.")
    for source in inputs:
        if not in_place and destination.exists() and source.exists() and destination.resolve() == source.resolve():
            raise OutputError(
                f"refusing to overwrite the input '{source}': choose another -o path, "
                "or pass --in-place to replace the input deliberately."
            )


@contextlib.contextmanager
def atomic_path(destination: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``destination``; rename it into place only on success.

    Any exception (a failed write, a full disk, Ctrl-C) removes the temporary file and leaves
    ``destination`` as it was.
    """
    destination = Path(destination)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".pathcond-tmp", dir=destination.parent or ".")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        if destination.exists():
            os.chmod(tmp, destination.stat().st_mode & 0o777)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, destination)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        reason = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        raise OutputError(f"cannot write '{destination}': {reason}. Nothing was written.") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(destination: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp_path)`` and move the result onto ``destination`` atomically."""
    with atomic_path(destination) as tmp:
        write(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
