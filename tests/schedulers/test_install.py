"""Installing the schedulers: a missing one is installed when it can be, else the reason to skip."""

from __future__ import annotations

import subprocess

import pytest

import slurm as slurm_mod


def test_nothing_is_missing_nothing_to_say(monkeypatch):
    monkeypatch.setattr(slurm_mod, "missing", lambda commands: [])
    assert slurm_mod.ensure_installed() is None


def test_without_root_the_reason_names_what_is_missing_and_the_script(monkeypatch):
    monkeypatch.setattr(slurm_mod, "missing", lambda commands: ["srun", "munged"])
    monkeypatch.setattr(slurm_mod.os, "geteuid", lambda: 1000)
    why = slurm_mod.ensure_installed()
    assert "srun, munged not installed" in why and "root" in why and "install_schedulers.sh" in why


def test_without_apt_get_the_reason_says_so(monkeypatch):
    monkeypatch.setattr(slurm_mod, "missing", lambda commands: ["mpirun"])
    monkeypatch.setattr(slurm_mod.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_mod.shutil, "which", lambda name: None)
    assert "apt-get" in slurm_mod.ensure_installed()


@pytest.mark.timeout(30)
def test_the_script_does_nothing_when_all_is_installed():
    if slurm_mod.missing(["slurmctld", "slurmd", "srun", "sinfo", "munged", "mpirun", "etcd"]):
        pytest.skip("the schedulers are not installed here")
    done = subprocess.run(["bash", str(slurm_mod.ROOT / "tools" / "install_schedulers.sh")], capture_output=True,
                          text=True, timeout=20)
    assert done.returncode == 0 and "nothing to do" in done.stdout, done.stdout + done.stderr
