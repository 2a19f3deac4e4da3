"""A pytest plugin for gpu_check.sh: each failure's traceback goes to FAILURE_STREAM as the test ends.

pytest prints tracebacks only in its closing summary, which a suite cut by the lease's time limit
never reaches; under pytest-xdist the reports arrive in the controller, where this plugin runs.
"""
import os


def pytest_runtest_logreport(report):
    if report.failed and os.environ.get("FAILURE_STREAM"):
        with open(os.environ["FAILURE_STREAM"], "a", encoding="utf-8") as stream:
            stream.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
