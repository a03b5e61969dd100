"""Tasks forked from the launch's fork server behave as fresh interpreters would (launch/forkserver.py).

Each case runs real tasks under the Supervisor with the fork server on: what the task sees (argv, exactly
its environment, working directory, import path, its own session, fresh random state), what others see of
it (/proc cmdline and environ, its exit code, its death by a signal), how an uncaught exception reads, and
what happens when the fork server itself dies.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from towerflow.launch import forkserver
from towerflow.launch.environment import ENV_FORK_SERVER
from towerflow.launch.supervisor import Supervisor
from towerflow.launch.task_process import TaskProcessSpec

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

PROBE = '''
import json, os, random, sys
me = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "env": dict(os.environ),
      "own_session": os.getsid(0) == os.getpid(), "random": random.random(), "ppid": os.getppid(),
      "cmdline": open(f"/proc/{os.getpid()}/cmdline", "rb").read().split(b"\\0")[:-1],
      "environ": open(f"/proc/{os.getpid()}/environ", "rb").read().split(b"\\0")[:-1]}
me["cmdline"] = [a.decode() for a in me["cmdline"] if a]
me["environ"] = sorted(a.decode() for a in me["environ"] if a)
with open(os.path.join(os.environ["OUT"], os.environ["NAME"] + ".json"), "w") as f:
    json.dump(me, f)
code = os.environ.get("EXIT")
if code == "raise":
    def deep():
        raise ValueError("the task's own error")
    deep()
sys.exit(int(code or 0))
'''


@pytest.fixture(autouse=True)
def _fork_server_on(monkeypatch):
    monkeypatch.setenv(ENV_FORK_SERVER, "1")


def _run(tmp_path: Path, tasks, max_restarts: int = 0):
    """Run `tasks` ([(argv tail, env)]) as workers; (exit code, stderr text, {name: what the probe saw})."""
    specs = [TaskProcessSpec("worker", i, [sys.executable, *argv], {"OUT": str(tmp_path), "NAME": f"t{i}", **env})
             for i, (argv, env) in enumerate(tasks)]
    out, err = io.StringIO(), io.StringIO()
    code = Supervisor(specs, out=out, err=err, max_restarts=max_restarts).run()
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("t*.json")}
    return code, err.getvalue() + out.getvalue(), seen


def test_a_forked_task_sees_exactly_what_a_fresh_interpreter_would(tmp_path, monkeypatch):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    monkeypatch.setenv("ONLY_THE_LAUNCHERS", "1")
    code, _, seen = _run(tmp_path, [([str(script), "a", "b"], {"X": "zero"}), ([str(script)], {"X": "one"})])
    assert code == 0
    for name, x, args in (("t0", "zero", ["a", "b"]), ("t1", "one", [])):
        task = seen[name]
        assert task["argv"] == [str(script), *args]
        assert task["env"]["X"] == x and task["env"]["ONLY_THE_LAUNCHERS"] == "1"  # inherited, as with Popen
        assert forkserver.ENV_ROOM_VAR not in task["env"]
        assert task["cwd"] == os.getcwd() and task["path0"] == str(tmp_path) and task["own_session"]
        assert task["cmdline"] == [sys.executable, str(script), *args]  # what ps and nvidia-smi show
        assert task["environ"] == sorted(f"{k}={v}" for k, v in task["env"].items())
    assert seen["t0"]["random"] != seen["t1"]["random"]  # each seeded from the OS, not the zygote's state
    assert seen["t0"]["ppid"] == seen["t1"]["ppid"] != os.getpid()  # both forked by the one zygote


def test_a_module_runs_as_with_python_dash_m(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(PROBE)
    code, _, seen = _run(tmp_path, [(["-m", "pkg.probe", "x"], {"PYTHONPATH": str(tmp_path)}),
                                    (["-m", "pkg.probe"], {"PYTHONPATH": str(tmp_path)})])
    assert code == 0
    assert seen["t0"]["argv"] == [str(package / "probe.py"), "x"]
    assert seen["t0"]["cmdline"] == [sys.executable, "-m", "pkg.probe", "x"]


def test_towerflow_preloaded_by_the_fork_server_reads_the_tasks_own_environment(tmp_path):
    """The fork server imports towerflow before any task exists: what towerflow takes from the environment is
    read in the task, after the fork (here the GPUs a task was launched with, under its visible_devices)."""
    script = tmp_path / "visible.py"
    script.write_text("import os, sys, towerflow\n"
                      "towerflow.configure(visible_devices=[1])\n"
                      "open(os.path.join(os.environ['OUT'], os.environ['NAME'] + '.json'), 'w').write("
                      "'\"' + os.environ['CUDA_VISIBLE_DEVICES'] + '\"')\n")
    code, text, seen = _run(tmp_path, [([str(script)], {"CUDA_VISIBLE_DEVICES": "4,5,6"}),
                                       ([str(script)], {"CUDA_VISIBLE_DEVICES": "7,8"})])
    assert code == 0, text
    assert seen == {"t0": "5", "t1": "8"}


def test_exit_codes_and_an_uncaught_exception_read_as_from_a_fresh_interpreter(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    code, text, _ = _run(tmp_path, [([str(script)], {"EXIT": "raise"}), ([str(script)], {"EXIT": "0"})])
    assert code == 1, text
    assert text.count("Traceback (most recent call last)") == 1, text
    assert "ValueError: the task's own error" in text and 'File "' + str(script) in text, text
    assert "zygote.py" not in text and "runpy" not in text, text  # the fork server's frames are not the task's
    code, text, _ = _run(tmp_path, [([str(script)], {"EXIT": "7"}), ([str(script)], {"EXIT": "0"})])
    assert code == 7, text
    code, text, _ = _run(tmp_path, [([str(tmp_path / "missing.py")], {}), ([str(script)], {})])
    assert code == 2 and "can't open file" in text and "missing.py" in text, text


def test_a_killed_task_reads_as_killed_and_is_restarted_from_the_fork_server(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\n"
                      "restart = os.environ.get('TOWERFLOW_RESTART_COUNT', '0')\n"
                      "open(os.path.join(sys.argv[1], f'pid.{restart}'), 'w').write(str(os.getpid()))\n"
                      "time.sleep(0 if restart != '0' else 60)\n")
    killer = tmp_path / "killer.py"
    killer.write_text("import os, signal, sys, time\n"
                      "f = os.path.join(sys.argv[1], 'pid.0')\n"
                      "while not os.path.exists(f) or not open(f).read(): time.sleep(0.05)\n"
                      "os.kill(int(open(f).read()), signal.SIGKILL)\n")
    specs = [TaskProcessSpec("worker", 0, [sys.executable, str(script), str(tmp_path)], {}),
             TaskProcessSpec("worker", 1, [sys.executable, str(killer), str(tmp_path)], {})]
    err = io.StringIO()
    started = time.monotonic()
    assert Supervisor(specs, out=io.StringIO(), err=err, max_restarts=1).run() == 0, err.getvalue()
    assert "/job:worker/task:0 (pid" in err.getvalue() and "was killed by signal 9; restarting it (1 of 1)" in err.getvalue()
    assert (tmp_path / "pid.1").exists() and time.monotonic() - started < 60


def test_tasks_die_with_the_fork_server_and_the_next_start_says_it_is_gone(tmp_path):
    server = forkserver.ForkServer()
    try:
        task = server.spawn([sys.executable, str(_write(tmp_path, "import time; time.sleep(60)"))], dict(os.environ))
        os.kill(server._proc.pid, signal.SIGKILL)
        assert task.wait(30) == -signal.SIGTERM  # PR_SET_PDEATHSIG: no task outlives its fork server
        with pytest.raises(OSError, match="fork server .* is gone"):
            server.spawn([sys.executable, str(tmp_path / "t.py")], dict(os.environ))
    finally:
        server.close()


def test_only_plain_script_and_module_commands_of_this_interpreter_are_forked():
    assert forkserver.forkable([sys.executable, "train.py", "--steps", "3"])
    assert forkserver.forkable([sys.executable, "-m", "towerflow.ps.serve"])
    assert not forkserver.forkable([sys.executable, "-c", "print(1)"])
    assert not forkserver.forkable([sys.executable, "-X", "dev", "train.py"])
    assert not forkserver.forkable(["/usr/bin/env", "python", "train.py"])
    assert not forkserver.forkable([sys.executable])


def test_the_fork_server_is_off_under_its_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_FORK_SERVER, "0")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    code, _, seen = _run(tmp_path, [([str(script)], {}), ([str(script)], {})])
    assert code == 0 and all(t["ppid"] == os.getpid() for t in seen.values())  # started by the launcher itself
    assert forkserver.ENV_ROOM_VAR not in os.environ


def _write(folder: Path, code: str) -> Path:
    path = folder / "t.py"
    path.write_text(code)
    return path


def test_a_fork_server_that_cannot_fork_answers_every_request_with_why(tmp_path):
    """The zygote refuses when its imports started CUDA (a forked child could not use the GPU)."""
    import pickle
    import socket
    import threading

    from towerflow.launch import zygote

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    refusing = threading.Thread(target=zygote._refuse, args=(theirs, "started CUDA"), daemon=True)
    refusing.start()
    for _ in range(2):
        r, w = os.pipe()
        socket.send_fds(ours, [pickle.dumps(forkserver.ForkRequest(("python", "x.py"), {}, "/"))], [w])
        assert pickle.loads(ours.recv(forkserver.MAX_MESSAGE)) == forkserver.ForkFailed("started CUDA")
        os.close(w)
        assert os.read(r, 1) == b""  # the zygote closed what it was sent: nobody holds the task's pipe
        os.close(r)
    ours.close()
    refusing.join(5)
    assert not refusing.is_alive()


def test_tasks_start_fresh_with_one_line_said_when_the_fork_server_fails(tmp_path):
    class Refusing:
        gone = None

        def spawn(self, argv, env):
            self.gone = "the fork server refused"
            raise OSError(self.gone)

    from towerflow.launch import task_process

    err = io.StringIO()
    script = _write(tmp_path, "import os; print(os.getppid())")
    refusing = Refusing()
    procs = [task_process.spawn([sys.executable, str(script)], dict(os.environ), refusing, err) for _ in range(2)]
    assert [p.wait(60) for p in procs] == [0, 0]
    assert [int(p.stdout.read()) for p in procs] == [os.getpid(), os.getpid()]  # fresh interpreters, our children
    assert err.getvalue().count("the fork server refused; starting the tasks as fresh interpreters instead") == 1


@pytest.mark.gpu
def test_forked_tasks_use_the_gpu(tmp_path):
    """The fork server never initializes CUDA (or refuses to fork), so its children can."""
    script = _write(tmp_path, "import torch; print(float((torch.ones(4, device='cuda') * 2).sum()))")
    out, err = io.StringIO(), io.StringIO()
    specs = [TaskProcessSpec("worker", i, [sys.executable, str(script)], {}) for i in range(2)]
    assert Supervisor(specs, out=out, err=err).run() == 0, err.getvalue()
    assert out.getvalue().count("8.0") == 2 and "fresh interpreters" not in err.getvalue(), err.getvalue()
