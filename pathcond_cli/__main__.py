"""The ``pathcond`` command and ``python -m pathcond_cli``.

Ctrl-C is handled from the first instruction on: the handler is installed before the command
line modules (typer, rich) are imported, and :func:`pathcond_cli.cli.main` replaces it with the
one that knows what a command has written.
"""

import os
import signal


def main() -> None:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    from .cli import main as run

    run()


def _interrupted_while_starting(signum, frame) -> None:
    os.write(2, b"interrupted: nothing was written; the input is unchanged.\n")
    os._exit(130)


if __name__ == "__main__":
    main()
