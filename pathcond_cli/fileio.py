"""Atomic file writes: a temporary file beside the target, fsync, then rename."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import OutputError

# Every temporary file or directory pathcond creates beside an output ends with this.
TMP_SUFFIX = ".pathcond-tmp"


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
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=TMP_SUFFIX, dir=destination.parent or ".")
        os.close(fd)
    except OSError as exc:
        raise OutputError(f"cannot write '{destination}': {_reason(exc)}. Nothing was written.") from None
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
        raise OutputError(f"cannot write '{destination}': {_reason(exc)}. Nothing was written.") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def staged_output(destination: Path) -> Iterator[Path]:
    """Yield where to write ``destination`` inside a fresh hidden directory beside it.

    The caller writes there (a format may add companion files, e.g. shards, next to it) and
    checks what it wrote; only when the block succeeds is every staged file renamed into
    ``destination``'s directory, companions first and ``destination`` last. On any failure
    (an exception, a failed verification, Ctrl-C) the staging directory is deleted and
    ``destination`` — which may be the input itself with ``--in-place`` — is left untouched.
    """
    destination = Path(destination)
    directory = destination.parent if str(destination.parent) else Path(".")
    try:
        stage = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=TMP_SUFFIX, dir=directory))
    except OSError as exc:
        raise OutputError(f"cannot write '{destination}': {_reason(exc)}. Nothing was written.") from None
    staged = stage / destination.name
    try:
        yield staged
        companions = sorted(p for p in stage.iterdir() if p != staged and not p.name.endswith(TMP_SUFFIX))
        try:
            for path in [*companions, staged]:
                final = directory / path.name
                os.chmod(path, final.stat().st_mode & 0o777 if final.is_file() else 0o666 & ~_umask())
                os.replace(path, final)
        except OSError as exc:
            raise OutputError(f"cannot write '{destination}': {_reason(exc)}.") from None
    except OutputError as exc:
        # Name the file the user asked for, not the hidden staging directory.
        raise OutputError(str(exc).replace(str(staged), str(destination))) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def atomic_write(destination: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp_path)`` and move the result onto ``destination`` atomically."""
    with atomic_path(destination) as tmp:
        write(tmp)


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "the disk is full"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return exc.strerror or str(exc)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
