"""The README's example runs unchanged on one device and on a parameter-server cluster."""

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess  # starts processes

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "quickstart.py")


def _accuracies(output: str):
    return [float(a) for a in re.findall(r"test accuracy: (\d\.\d{4})", output)]


def test_readme_embeds_the_quickstart_verbatim():
    readme = (ROOT / "README.md").read_text()
    body = pathlib.Path(SCRIPT).read_text().split('"""\n', 1)[1]
    assert body.strip() in readme


@pytest.mark.parametrize(
    "launch",
    [[], ["-m", "towerflow", "launch", "--ps", "1", "--workers", "2"]],
    ids=["one-device", "ps-cluster"],
)
@pytest.mark.timeout(180)
def test_quickstart_learns_under_each_launch_line(launch):
    command = [sys.executable, *launch, SCRIPT] if launch else [sys.executable, SCRIPT]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    accuracies = _accuracies(done.stdout)
    assert len(accuracies) == 1, done.stdout  # only the chief prints
    assert accuracies[0] >= 0.85
