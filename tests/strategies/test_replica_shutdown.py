"""A replica's shutdown lets go of its process group: once the strategy is shut down, even with the model still
held (a global of the script, or in a reference cycle), no gloo thread is left in the process, so none is still
running, nor torn down, when the interpreter exits."""

import os
import re

import pytest

from _replicas import REPO, run_replicas

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SCRIPT = os.path.join(REPO, "tests", "strategies", "_shutdown_script.py")


def test_no_gloo_thread_outlives_the_strategy_while_the_model_is_held():
    results = run_replicas([SCRIPT], 2, timeout=90, env={"CUDA_VISIBLE_DEVICES": ""})  # gloo: the CPU group
    for r in results:
        during = re.search(r"during training: (\d+) gloo threads", r.stdout)
        after = re.search(r"after shutdown: (\d+) gloo threads", r.stdout)
        assert during and after, r.stdout + r.stderr
        assert int(during.group(1)) > 0, r.stdout  # the check sees gloo's threads when they exist
        assert int(after.group(1)) == 0, r.stdout
