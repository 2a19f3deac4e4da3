"""The ``pathcond`` command and ``python -m pathcond_cli``.

Ctrl-C and SIGTERM are handled from this module's first instructions on: the handler is
installed when the module is imported, through the C-level ``_signal`` module (loaded at interpreter start-up,
unlike ``signal``, whose enum classes take a moment to build), before the command line modules
(typer, rich) are imported; :func:`pathcond_cli.cli.app.main` replaces it with the one that knows
what a command has written.
"""

import _signal
import os


def _interrupted_while_starting(signum, frame) -> None:
    label = b"terminated (SIGTERM)" if signum == _signal.SIGTERM else b"interrupted"
    os.write(2, label + b": nothing was written; the input is unchanged.\n")
    os._exit(128 + signum)


_signal.signal(_signal.SIGINT, _interrupted_while_starting)
_signal.signal(_signal.SIGTERM, _interrupted_while_starting)

# torch's CPU allocator asks for transparent huge pages for blocks of 2 MiB and more when this is
# set before its first allocation: each parameter-sized float64 copy a pass makes is then faulted
# in 2 MiB at a time, not 4 KiB (the 200 MB MLP's `rescale`: 3.5 s of system time instead of 5.9,
# the same peak memory). A value the user set is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def main() -> None:
    from .cli.app import main as run

    run()


if __name__ == "__main__":
    main()
