"""The fork server's own process: import torch once, then fork a task for each request (`forkserver.py`).

    python -m towerflow.launch.zygote FD    # FD: the launcher's end of a socketpair

It stays single-threaded (torch starts no thread at import; numpy's BLAS pool handles fork itself) and
never initializes CUDA, so a child may use any device. A child undoes what the zygote set for itself,
then becomes the task (`_become`) and runs it as `python SCRIPT` or `python -m MODULE` would; the
interpreter then ends as usual (atexit, non-daemon threads joined). Each child's exit is reported to
the launcher; the zygote ends when the launcher closes its end.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import importlib
import io
import os
import pickle
import random
import runpy
import select
import signal
import socket
import sys
from typing import List, Optional, Tuple

from towerflow import library_env
from towerflow.launch import environment as _env
from towerflow.launch.forkserver import MAX_MESSAGE, Exited, ForkFailed, Forked, ForkRequest

_PR_SET_PDEATHSIG = 1


# What nearly every task imports first: torch (most of a fresh process's start), its distributed and
# neural-network packages, torch._dynamo (which a process's first optimizer imports: 3 s of a core), numpy, and
# towerflow's own strategies, ps sides and cluster server (0.5 s more). Named, not imported here: the fork server
# sits below the layers it preloads. None of them starts a thread or CUDA at import.
PRELOADED = ("numpy", "torch", "torch._dynamo", "torch.distributed", "torch.nn", "torch.optim",
             "towerflow.strategies", "towerflow.ps.worker.client", "towerflow.ps.server.endpoints",
             "towerflow.cluster.server", "towerflow.training")


def _preload() -> None:
    library_env.assign("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # should anything count GPUs: NVML, not the CUDA driver
    for name in PRELOADED:
        importlib.import_module(name)


def _cuda_initialized() -> bool:
    """Whether torch started CUDA in this process, after which a forked child could not use the GPU
    ("initialization error"). The driver library being loaded is not enough: CUDA builds of torch load it
    at import, and a child still initializes CUDA for itself."""
    import torch

    return torch.cuda.is_initialized()


def _refuse(sock: socket.socket, why: str) -> None:
    """Answer every request with `why` until the launcher closes its end (it starts those tasks afresh)."""
    while True:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 3)
        for fd in fds:
            os.close(fd)
        if not data or not _tell(sock, ForkFailed(why)):
            return


def _serve(sock: socket.socket) -> Optional[Tuple[ForkRequest, List[int], int]]:
    """Fork a task for each request and report every exit; returns (request, fds, zygote pid) in a child,
    None once the launcher is gone."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's exit wakes the select below
    children = set()
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid in list(children):  # only our own children: waitpid(-1) would take no more than these either
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                if not _tell(sock, Exited(pid, os.waitstatus_to_exitcode(status))):
                    return None
        if sock not in ready:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 3)
        if not data:
            return None
        request = pickle.loads(data)
        me = os.getpid()
        try:
            pid = os.fork()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            if not _tell(sock, ForkFailed(f"fork failed: {e}")):
                return None
            continue
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.close()
            return request, fds, me
        children.add(pid)
        for fd in fds:
            os.close(fd)
        if not _tell(sock, Forked(pid)):
            return None


def _tell(sock: socket.socket, message) -> bool:
    """Send `message` to the launcher; False when it is gone (its end closed)."""
    try:
        sock.send(pickle.dumps(message))
        return True
    except OSError:
        return False


def _become(request: ForkRequest, fds: List[int], zygote: int) -> None:
    """Turn this child into a fresh task process: session, parent-death signal, stdio, directory, environment,
    random state, thread count and import path as a new interpreter would have them."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != zygote:  # the zygote died before the signal was set: end as the signal would have
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(1)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request.cwd)
    _env.become(request.env)  # every variable now lives on the heap: the original block may be written over
    _show_as(request.argv, request.env)
    unbuffered = bool(request.env.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=sys.stdin.encoding)
    sys.stdout = sys.__stdout__ = _text_out(1, unbuffered, sys.stdout)
    sys.stderr = sys.__stderr__ = _text_out(2, True, sys.stderr)
    if request.env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    random.seed()  # a fresh interpreter seeds from the OS; a fork would share the zygote's state
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    threads = request.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read at the zygote's start, before this task's value existed
        import torch

        torch.set_num_threads(int(threads))
    extra = [p for p in request.env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra


def _show_as(argv, env) -> None:
    """Write the task's command line and environment over the zygote's in this process's memory, so that `ps`,
    /proc/PID/cmdline and /proc/PID/environ (and the tools that read them: nvidia-smi, `towerflow smi`) show
    the task, as setproctitle does; the zygote was started with room to spare in both (forkserver.py)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(fields[n - 3]) for n in (48, 49, 50, 51))
    except (OSError, ValueError, IndexError):  # a kernel before 3.5, or no /proc
        return
    for start, end, strings in ((arg_start, arg_end, list(argv)), (env_start, env_end, [f"{k}={v}" for k, v in env.items()])):
        if end - start < 2:
            continue
        data = b"".join(s.encode(errors="replace") + b"\0" for s in strings)[:end - start - 1]
        ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def _text_out(fd: int, unbuffered: bool, like) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding=like.encoding, errors=like.errors, line_buffering=not unbuffered,
                            write_through=unbuffered)


def _run(argv: Tuple[str, ...]) -> None:
    """Run the task as `python SCRIPT ARGS` or `python -m MODULE ARGS`; an uncaught exception is shown as the
    interpreter would show it (through sys.excepthook, without this module's frames) and exits 1."""
    here = os.path.abspath(__file__)
    try:
        if argv[1] == "-m":
            sys.argv = ["-m", *argv[3:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            script = argv[1]
            if not os.path.exists(script):
                print(f"{sys.executable}: can't open file {os.path.abspath(script)!r}: [Errno 2] No such file or "
                      "directory", file=sys.stderr)
                sys.exit(2)
            sys.argv = [script, *argv[2:]]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (here, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # the hook prints the exception's own traceback
        if isinstance(e, KeyboardInterrupt):  # as the interpreter does: end by the signal itself
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    _preload()
    if _cuda_initialized():
        _refuse(sock, "the fork server's imports started CUDA, so its children could not use a GPU")
        os._exit(0)
    # The preloaded modules' objects live as long as any task: out of every garbage collection of the children,
    # which then scan only their own (an exit's collections: 0.35 s instead of 1.2 s of a core), and untouched by
    # them, so their pages stay shared with this process instead of being copied on write.
    gc.freeze()
    child = _serve(sock)
    if child is None:  # the launcher closed its end: nothing here to flush or finalize
        os._exit(0)
    request, fds, zygote = child
    _become(request, fds, zygote)
    _run(request.argv)


if __name__ == "__main__":
    main()
