"""``python tests/fake_cuda_main.py ARGS``: the pathcond command on the fake CUDA device (test-only).

``cli_support.module_command`` starts CLI subprocesses through this script when the suite
runs under the fake device (``PATHCOND_FAKE_CUDA=1``).
"""

import sys

from fake_cuda import installed

import pathcond_cli.__main__ as entry  # first: its Ctrl-C handler is installed before torch is imported

if __name__ == "__main__":
    del sys.path[0]  # this tests folder: its helper modules must not shadow anything pathcond imports
    with installed():
        entry.main()
