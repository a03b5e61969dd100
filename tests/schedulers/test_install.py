"""The Debian packages the tests need: tools/install_schedulers.sh installs them (`make test` runs it before
pytest); the tests only check that the commands are there, and skip naming the script when they are not."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import _etcd
import slurm as slurm_mod

SCRIPT = slurm_mod.ROOT / "tools" / "install_schedulers.sh"
PACKAGES = "slurm-wlm munge openmpi-bin etcd-server redis-server"


def _runs_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a check ran a command: {args}")

    for mod in (slurm_mod, _etcd):
        monkeypatch.setattr(mod.subprocess, "run", refuse)
        monkeypatch.setattr(mod.subprocess, "Popen", refuse)


def test_nothing_is_missing_nothing_to_say(monkeypatch):
    monkeypatch.setattr(slurm_mod, "missing", lambda commands: [])
    assert slurm_mod.why_missing() is None


def test_the_reason_names_what_is_missing_and_the_script_and_installs_nothing(monkeypatch):
    _runs_nothing(monkeypatch)
    monkeypatch.setattr(slurm_mod, "missing", lambda commands: ["srun", "munged"])
    monkeypatch.setattr(slurm_mod.os, "geteuid", lambda: 0)  # root with apt-get: still only a reason
    why = slurm_mod.why_missing()
    assert why.startswith("srun, munged not installed") and "tools/install_schedulers.sh" in why, why


def test_without_etcd_the_reason_names_the_script_and_installs_nothing(monkeypatch):
    _runs_nothing(monkeypatch)
    monkeypatch.setattr(_etcd.shutil, "which", lambda name: None)
    why = _etcd.unavailable()
    assert why.startswith("etcd is not installed") and "tools/install_schedulers.sh" in why, why


@pytest.mark.parametrize("uid, apt_get, reason", [("1000", True, "installing needs root"),
                                                   ("0", False, "there is no apt-get here")])
def test_the_script_names_what_is_missing_and_why_it_cannot_install(tmp_path, uid, apt_get, reason):
    bin_dir = tmp_path / "bin"  # a PATH without any of the packages' commands
    bin_dir.mkdir()
    (bin_dir / "date").symlink_to(shutil.which("date"))
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    ran = tmp_path / "apt-get ran"
    if apt_get:
        (bin_dir / "apt-get").write_text(f"#!/bin/sh\ntouch '{ran}'\n")
    for f in bin_dir.iterdir():
        if not f.is_symlink():
            f.chmod(0o755)
    done = subprocess.run([shutil.which("bash"), str(SCRIPT), "5"], capture_output=True, text=True, timeout=20,
                          env={**os.environ, "PATH": str(bin_dir)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"missing {PACKAGES}, and {reason}" in done.stderr, done.stderr
    assert not ran.exists()


@pytest.mark.timeout(30)
def test_the_script_does_nothing_when_all_is_installed():
    if slurm_mod.missing(["slurmctld", "slurmd", "srun", "sinfo", "munged", "mpirun", "etcd", "redis-server"]):
        pytest.skip("the packages are not installed here (bash tools/install_schedulers.sh)")
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0 and f"nothing to do ({PACKAGES} already installed)" in done.stdout, \
        done.stdout + done.stderr
