"""A pytest plugin of benchmarks/gpu_session.sh (`-p _failures_now`): each failure is written to OUT/failures-PID.log
the moment its report arrives, so a run cut short by its bound still says why every test it ran failed."""

import os


def pytest_runtest_logreport(report):
    if not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes, once
        return
    with open(os.path.join(os.environ.get("OUT", "gpu-results"), f"failures-{os.getpid()}.log"), "a") as f:
        f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
