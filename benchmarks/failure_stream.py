"""A pytest plugin for gpu_check.sh: each failure's traceback goes to FAILURE_STREAM as the test ends.

pytest prints tracebacks only in its closing summary, which a suite cut by the lease's time limit
never reaches. Under pytest-xdist the workers' reports also reach the controller: only the
controller writes, so that each failure is written once.
"""

import os

_writes = True


def pytest_configure(config):
    global _writes
    _writes = not hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    if _writes and report.failed and os.environ.get("FAILURE_STREAM"):
        with open(os.environ["FAILURE_STREAM"], "a", encoding="utf-8") as stream:
            stream.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
