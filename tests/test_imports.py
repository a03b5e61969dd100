"""The commands that only start or watch processes (launch, top, report, cluster) never import torch,
and the package's names behave as if imported eagerly: each check in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import pytest

pytestmark = pytest.mark.multiprocess  # starts processes


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_launching_and_watching_do_not_import_torch():
    out = _python(
        "import sys, towerflow\n"
        "from towerflow.cli import build_parser; build_parser()\n"
        "import towerflow.launch.local, towerflow.launch.supervisor, towerflow.launch.verdict\n"
        "import towerflow.monitoring.top, towerflow.monitoring.runstate, towerflow.cli.cluster\n"
        "from towerflow.launch import plan_local\n"
        "plan_local(['x.py'], ps=1, workers=2)\n"
        "towerflow.ClusterSpec({'worker': ['a:1']}); towerflow.DeviceSpec.parse('cuda:1'); towerflow.TowerflowError\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    assert out.strip() == "[]", f"imported torch: {out[:300]}"


def test_configure_first_applies_to_devices_and_placement():
    # configure() before anything else imported: the layers that apply options register first.
    out = _python(
        "import towerflow\n"
        "towerflow.configure(logical_devices={'CPU': 2}, allow_soft_placement=True, log_device_placement=True)\n"
        "print(len([d for d in towerflow.list_devices() if d.device_type == 'CPU']), towerflow.configure().allow_soft_placement)\n"
        "import torch\n"
        "with towerflow.device('/cpu:1'):\n"
        "    torch.ones(2)\n"
        "print(towerflow.placement_log().records[-1].device)\n"
    )
    count, soft, device = out.split()
    assert (count, soft) == ("2", "True")
    assert device.endswith("/device:CPU:1")


def test_every_public_name_resolves():
    out = _python("import towerflow\nmissing = [n for n in towerflow.__all__ if getattr(towerflow, n, None) is None]\n"
                  "print(missing, set(towerflow.__all__) <= set(dir(towerflow)))\n"
                  "from towerflow import MirroredStrategy, remote, device\nprint(callable(remote), callable(device))")
    assert out.split("\n")[:2] == ["[] True", "True True"], out


def test_subpackages_are_reached_through_the_package_name_alone():
    out = _python("import sys, towerflow\n"
                  "print('towerflow.ps' in sys.modules)\n"
                  "print(type(towerflow.ps.SparseAdam(lr=0.1)).__name__, towerflow.training.save_metrics.__name__)\n"
                  "print('ps' in dir(towerflow))\n"
                  "try:\n    towerflow.nonexistent\nexcept AttributeError as e:\n    print(e)")
    assert out.splitlines() == ["False", "SparseAdam save_metrics", "True",
                                "module 'towerflow' has no attribute 'nonexistent'"], out


def test_no_module_imports_torch_distributed_rpc_and_only_the_messaging_layer_imports_zmq():
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "src" / "towerflow"
    rpc, zmq = [], []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            where = str(path.relative_to(src))
            if any(n == "torch.distributed.rpc" or n.startswith("torch.distributed.rpc.") for n in names):
                rpc.append(where)
            if any(n == "zmq" or n.startswith("zmq.") for n in names):
                zmq.append(where)
    assert rpc == []
    assert sorted(set(zmq)) == ["cluster/calls/connection_events.py", "cluster/calls/direct.py",
                                "cluster/calls/messaging.py", "cluster/calls/wire_security.py"]


def test_a_process_that_serves_no_remote_calls_does_not_load_zmq():
    out = _python(
        "import sys, towerflow\n"
        "import towerflow.strategies.environment, towerflow.cluster.calls.endpoint, towerflow.cluster.server\n"
        "import towerflow.ps.server.endpoints, towerflow.ps.worker.client\n"
        "print('zmq' in sys.modules)\n"
    )
    assert out.strip() == "False"  # an all-reduce replica imports these, and never binds an endpoint


def test_the_worker_side_of_a_ps_step_loads_nothing_of_the_ps_side():
    # its calls name the ps's endpoints (messages.Endpoints) and pickle without importing them
    out = _python(
        "import pickle, sys\n"
        "import towerflow.ps.worker.optimizer, towerflow.ps.worker.lookups\n"
        "from towerflow.ps.messages import Endpoints\n"
        "pickle.dumps(Endpoints.push_pull)\n"
        "print(sorted(m for m in sys.modules if m.startswith('towerflow.ps.server')))\n"
    )
    assert out.strip() == "[]", out


def test_only_the_task_reader_the_launcher_and_library_settings_touch_os_environ():
    """A task learns its place from one reader (taskenv), which never writes it back; the launcher writes
    what its tasks inherit; the libraries that read only their environment (CUDA's visible devices,
    gloo's interface, cuBLAS) are set through one module. Nothing else reads or writes it."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "src" / "towerflow"
    touching, writes = set(), set()
    for path in src.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([node.attr] if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                     and node.value.id == "os" else [a.name for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module == "os" else [])
            if set(names) & {"environ", "getenv", "putenv", "unsetenv", "environb"}:
                touching.add(str(path.relative_to(src)))
            environ = (lambda n: isinstance(n, ast.Attribute) and n.attr == "environ")
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                if any(isinstance(t, ast.Subscript) and environ(t.value) for t in targets):
                    writes.add(str(path.relative_to(src)))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and environ(node.func.value)
                    and node.func.attr in ("pop", "update", "setdefault", "clear", "popitem")):
                writes.add(str(path.relative_to(src)))
    assert sorted(touching) == ["launch/environment.py", "library_env.py", "taskenv.py"]
    assert sorted(writes) == ["launch/environment.py", "library_env.py"]
