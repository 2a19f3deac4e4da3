"""``python tests/fake_cuda_main.py ARGS``: the pathcond command on the fake CUDA device (test-only).

``cli_support.module_command`` starts CLI subprocesses through this script when the suite
runs under the fake device (``PATHCOND_FAKE_CUDA=1``).
"""

import sys

import pathcond_cli.__main__ as entry  # its Ctrl-C handler is installed before torch is imported

if __name__ == "__main__":
    # fake_cuda imports torch: only now, so that Ctrl-C during that import is the command's as on a
    # real `pathcond` (an interrupt that Python's own handler took inside numpy's or torch's import
    # was swallowed there, and the run went on with a broken torch: a RecursionError, or numpy's
    # "cannot load module more than once", instead of exit 130)
    from fake_cuda import installed

    del sys.path[0]  # this tests folder: its helper modules must not shadow anything pathcond imports
    with installed():
        entry.main()
