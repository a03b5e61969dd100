"""examples/serve_ctr.py scores the CTR example's held-out records from its export and from its publications, with
the AUC the chief printed at the end of training (2 ps tasks, 1 worker: the last checkpoint is the final state)."""

from __future__ import annotations

import re

import pytest

from _cluster_procs import ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
pytest.importorskip("pyarrow")

DATA = ("--rows", "10000", "--tables", "4", "--test-size", "5000")


def _auc(text: str) -> str:
    found = re.findall(r"test auc: (\d\.\d{4})", text)
    assert found, text
    return found[-1]


def test_the_export_and_the_followed_publications_score_what_the_chief_scored(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--ps", "2", "--workers", "1", "--logdir", str(tmp_path / "run"),
                          "--publish-every", "0.5", str(ROOT / "examples" / "ctr_ps.py"), *DATA, "--steps", "100",
                          "--save-checkpoint-steps", "50", label="train")
    assert run.wait(180) == 0, run.describe()
    chief = _auc(run.out)
    export = launcher.python("-m", "towerflow", "export", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                             label="export")
    assert export.wait(60) == 0, export.describe()
    served = launcher.python(str(ROOT / "examples" / "serve_ctr.py"), "--model", str(tmp_path / "out"), *DATA,
                             label="serve-export")
    assert served.wait(120) == 0, served.describe()
    followed = launcher.python(str(ROOT / "examples" / "serve_ctr.py"), "--follow", str(tmp_path / "run" / "publish"),
                               *DATA, "--steps", "100", label="serve-follow")
    assert followed.wait(120) == 0, followed.describe()
    assert _auc(served.out) == chief and _auc(followed.out) == chief
    assert float(chief) > 0.75  # trained
