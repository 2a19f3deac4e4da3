"""Errors pathcond raises, each with the process exit code the CLI maps it to."""

from __future__ import annotations

from collections.abc import Iterable


class PathcondError(Exception):
    """Base class: a clear, one-paragraph message for the user and a distinct exit code."""

    exit_code = 1


class UsageError(PathcondError):
    """The call itself is wrong (an option, an argument, two outputs naming one file), whatever the files hold:
    exit 2, like the CLI's own."""

    exit_code = 2


class InputError(PathcondError):
    """The model file, spec or checkpoint cannot be read or does not match its description."""

    exit_code = 3


class UnsupportedModelError(PathcondError):
    """The network is readable but is not a ReLU DAG that pathcond can rescale exactly."""

    exit_code = 4

    def __init__(self, message: str, problems: list[str] | None = None, follow_on: list[str] | None = None,
                 note: str | None = None):
        """``problems`` are the root causes; ``follow_on`` the problems of nodes that only read
        the output of a refused node (counted in the message; ``complete`` lists them all);
        ``note`` a paragraph closing the message (why, and what would help), given once."""
        root = list(problems or [])
        self.follow_on = list(follow_on or [])
        self.problems = root + self.follow_on
        lines = [f"  - {p}" for p in root]
        closing = [note] if note else []
        self.complete = "\n".join([message, *lines, *(f"  - {p}" for p in self.follow_on), *closing])
        if self.follow_on:
            lines.append(f"  and {len(self.follow_on)} more problem(s) in nodes that read the output of those above, "
                         "consequences of them (listed with --json; in the API, the error's follow_on)")
        super().__init__("\n".join([message, *lines, *closing]) if lines or closing else message)


class VerificationError(PathcondError):
    """The rescaled model does not compute the original function within tolerance."""

    exit_code = 5


class OutputError(PathcondError):
    """The output cannot be written (missing directory, permissions, disk full, input clash)."""

    exit_code = 6


class InvalidWeightsError(PathcondError):
    """A parameter tensor holds NaN or Inf."""

    exit_code = 7


class StorageError(PathcondError):
    """The rescaled tensors cannot be held by the checkpoint's dtypes (values would overflow or be
    flushed below the smallest normal): with ``--max-log-scale none`` or a bound of the user's."""

    exit_code = 8


class MismatchError(PathcondError):
    """Two models that must share one architecture (``compare``) do not: another DAG, other
    tensor names or shapes."""

    exit_code = 10


EXIT_CODES = {
    "success": 0,
    "usage": UsageError.exit_code,
    "unreadable_input": InputError.exit_code,
    "unsupported_model": UnsupportedModelError.exit_code,
    "verification_failed": VerificationError.exit_code,
    "output_not_written": OutputError.exit_code,
    "invalid_weights": InvalidWeightsError.exit_code,
    "not_storable": StorageError.exit_code,
    "models_differ": MismatchError.exit_code,
    "interrupted": 130,
    "terminated": 143,
    "several_failures": 9,
}


def batch_exit_code(failures: Iterable[int]) -> int:
    """The exit status of a run over several files, from the exit codes of those that failed:
    0 when none failed, the code they share when every failure has the same one, else 9."""
    codes = set(failures)
    if not codes:
        return EXIT_CODES["success"]
    if len(codes) == 1:
        return codes.pop()
    return EXIT_CODES["several_failures"]
