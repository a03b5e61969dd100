"""`--ps-replicas 2` under SIGKILL: a job whose ps tasks are killed ends with exactly the ps values of the
same job left alone, update for update (tests/ps/_replica_train.py: one worker async, or two in sync, on
seeded batches; the chief kills ps tasks early, mid-run and after a checkpoint). And a part whose every
replica is lost falls back to the newest checkpoint, with the loss reported; a ps task lost during a restore, with
mirrors and without, is waited for and the restore runs again."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil

import pytest
import torch

from tests.ps._launch import launch

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_replica_train.py")
TIMEOUT = 150  # a launch's hard deadline (it then stops every task); a run takes 10-40 s on the 2-core box
pytestmark = pytest.mark.timeout(TIMEOUT + 60)  # above the launch's, so that its own cleanup runs first


@pytest.fixture(autouse=True)
def _restarts_not_promotions(monkeypatch):
    """These jobs wait for a lost ps task's restart, which takes 2-15 s on a loaded machine; a backup promoted
    meanwhile is another path (its own test sets a short wait)."""
    monkeypatch.setenv("TOWERFLOW_PS_PROMOTE_AFTER", "300")


def _launch(flags, folder, steps, model, kills) -> str:
    os.makedirs(folder, exist_ok=True)
    return launch([*flags, "--ps-replicas", "2", "--max-restarts", "3", HELPER, str(folder), str(steps), model, kills],
                  TIMEOUT)


def _final(folder) -> dict:
    return torch.load(os.path.join(folder, "final.pt"), weights_only=False, map_location="cpu")


def _assert_equal(a, b, where: str) -> None:
    """Equal structure, tensors bit for bit; `where` says which part differs."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and {str(k) for k in a} == {str(k) for k in b}, where
        by_name = {str(k): v for k, v in b.items()}
        for k, v in a.items():
            _assert_equal(v, by_name[str(k)], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _killed_and_left_alone(tmp_path, flags, steps, model, kills):
    """The job with `kills` and without, at once; (killed run's final, reference final, killed run's output)."""
    runs = {"killed": kills, "alone": "none"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outputs = dict(zip(runs, pool.map(lambda k: _launch(flags, tmp_path / k, steps, model, runs[k]), runs)))
    return _final(tmp_path / "killed"), _final(tmp_path / "alone"), outputs["killed"]


CASES = {
    # each model holds dense variables (a head, with Adam) beside its tables, so a case covers both kinds
    # a fixed table and a hash vocabulary; one worker: with two, their reads race, and the order in which hash
    # ids are admitted (and draw their rows) differs between two runs left alone
    "async": (["--ps", "2", "--workers", "1"], 50, "tables", "4:0,23:1,43:0"),
    "sync": (["--ps", "2", "--workers", "2", "--mode", "sync"], 40, "sparse", "7:1,26:0"),
    # two ps tasks at once, neither the other's backup (0's part is mirrored on 1, 2's on 3): both from mirrors;
    # then ps task 1, and ps task 3 right after the chief sent the first part of that restore: it runs again
    "two-at-once": (["--ps", "4", "--workers", "1"], 30, "dense", "12:0+2,20:1+create3"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_ps_task_loses_no_update(tmp_path, case):
    flags, steps, model, kills = CASES[case]
    killed, alone, output = _killed_and_left_alone(tmp_path, flags, steps, model, kills)
    assert killed["global_step"] == alone["global_step"] == steps, output
    for kind in ("variables", "tables"):
        assert killed[kind].keys() == alone[kind].keys()
        for name in alone[kind]:
            assert torch.equal(killed[kind][name], alone[kind][name]), (kind, name)
    _assert_equal(killed["ps_state"], alone["ps_state"], "ps_state")  # optimizer and table state, clocks
    recoveries = killed["recoveries"]
    assert len(recoveries) == len(kills.split(",")), output  # tasks lost together are one recovery
    assert all(r["from_mirrors"] and r["steps_lost"] == 0 for r in recoveries), recoveries
    assert output.count("the chief restored it from its mirror") >= len(recoveries)
    for task in re.findall(r"create(\d+)", kills):  # lost during a restore: part of that recovery
        assert f"killed ps task {task} (pid" in output and "after the restore sent its first part" in output, output
        assert any(int(task) in r["ps_task"] for r in recoveries if isinstance(r["ps_task"], list)), recoveries


def test_a_part_with_every_replica_lost_comes_back_from_the_checkpoint(tmp_path):
    """Three ps tasks, two killed at once: ps task 0's part lived on tasks 0 and 1, so it is gone; every ps task
    goes back to the step-20 checkpoint, the chief says why, and training still ends. The third is killed right after
    the chief sent the first part of that checkpoint: the restore runs again once it is back too."""
    output = _launch(["--ps", "3", "--workers", "1"], tmp_path, 40, "dense", "26:0+1+create2")
    final = _final(tmp_path)
    assert "lost every replica of its part" in output
    assert "killed ps task 2" in output and "after the restore sent its first part" in output, output
    (record,) = final["recoveries"] if len(final["recoveries"]) == 1 else pytest.fail(f"{final['recoveries']}\n{output}")
    # either of the two killed at once may go unseen (restarted before the worker called it): followed anyway
    assert 2 in record["ps_task"] and {0, 1} & set(record["ps_task"]), record
    assert output.count("waiting for its restart") == len(record["ps_task"]), output  # each loss said once
    assert not record["from_mirrors"] and record["checkpoint"].endswith("ckpt-0000000020.pt") and record["steps_lost"] > 0
    # the worker takes its 40 steps: the ones since the checkpoint are gone, and the one in flight
    assert 40 - record["steps_lost"] - 1 <= final["global_step"] <= 40 - record["steps_lost"]


def test_with_a_replica_lag_a_killed_ps_task_loses_at_most_that_many_pushes(tmp_path, monkeypatch):
    """--ps-replica-lag N: replies run ahead of the backup, so a restored primary may lack some acknowledged pushes;
    the job goes on, and each recovery counts what it lost, never more than N per ps task."""
    monkeypatch.setenv("TOWERFLOW_PS_LINK", "zmq")  # replication over messages, whose acks are read only when due
    lag, steps = 16, 50
    output = _launch(["--ps", "2", "--workers", "1", "--ps-replica-lag", str(lag)], tmp_path, steps, "dense", "15:0,35:1")
    final = _final(tmp_path)
    recoveries = final["recoveries"]
    assert len(recoveries) == 2 and all(r["from_mirrors"] for r in recoveries), output
    assert all(0 <= r["pushes_lost"] <= lag for r in recoveries), recoveries
    lost = sum(r["pushes_lost"] for r in recoveries)
    assert steps - lost <= final["global_step"] <= steps, (final["global_step"], recoveries)


def test_the_chief_lost_with_a_ps_task_restores_it_from_its_mirror(tmp_path):
    """A host holding the chief and ps task 1 goes down: the restarted chief finds that task empty beside one that
    kept its state and restores it from its mirror (not afresh from its own initial values), and no push of either
    worker is lost: the other worker's (it may still be training, or have finished its steps before the chief's
    step 15) and those of the chief's first incarnation."""
    output = _launch(["--ps", "2", "--workers", "2"], tmp_path, 100, "dense", "15:1+chief")
    final = _final(tmp_path)
    assert "killed ps tasks [1]" in output and "and the chief" in output
    assert re.search(r"restored /job:ps/task:1(, lost together with this chief,)? from its mirror", output), output
    kept = re.search(r"\[worker:0\] .*rejoined training \(restart 1\) .*the ps kept its (\d+) earlier pushes", output)
    assert kept, output
    # the other worker's 100 pushes, the chief's first incarnation's, and the 100 of its restarted one
    assert final["global_step"] == 100 + int(kept.group(1)) + 100, output
    for line in re.findall(r"\[worker:1\] .*/job:ps/task:1 is back.*", output):  # said only if it was still training
        assert "from its mirror" in line and "lost: nothing" in line, output


def test_the_chief_lost_with_a_ps_task_and_no_mirror_restores_every_ps_task_from_the_checkpoint(tmp_path):
    """The same host loss without mirrors (`--ps-replicas 1`): the empty ps task's part lives only in the checkpoint,
    so the restarted chief puts every ps task back to it (never the empty one afresh beside the other's newer
    state), says so, and the other worker, if it was still training, waits for that restore and goes on from it."""
    os.makedirs(tmp_path, exist_ok=True)
    output = launch(["--ps", "2", "--workers", "2", "--max-restarts", "3", HELPER, str(tmp_path), "40", "dense",
                     "15:1+chief"], TIMEOUT)
    final = _final(tmp_path)
    assert "killed ps tasks [1]" in output and "and the chief" in output
    assert re.search(r"\[worker:0\] .*/job:ps/task:1 came back empty together with this restarted chief, with no "
                     r"mirror to restore from: restored every ps task from ckpt-\d+", output), output
    if re.search(r"\[worker:1\] .*lost /job:ps/task:1", output):  # (it may have finished its steps before the kill)
        assert re.search(r"\[worker:1\] .*/job:ps/task:1 is back .*the chief restored the ps tasks", output), output
    (record,) = final["recoveries"]  # the restarted chief's own
    assert record["lost_with_chief"] and not record["from_mirrors"]
    # from that checkpoint's step on (the other worker trains on between the restore and the chief's pull: a few
    # pushes on a loaded machine, a few dozen on a fast one)
    assert 0 <= record["resumed_at_step"] - int(re.search(r"ckpt-(\d+)", record["checkpoint"]).group(1)) < 40
    assert final["global_step"] >= 40


@pytest.mark.skipif(shutil.which("ss") is None, reason="cutting a live task's connections needs `ss -K` (iproute2)")
def test_connections_cut_to_ps_tasks_that_live_on_lose_no_update(tmp_path, monkeypatch):
    """Every TCP connection to a ps task aborted while it runs (`ss -K`; steps over TCP, TOWERFLOW_PS_LINK=zmq): no
    restart comes, so the worker, seeing the task beat on, connects to it again and sends what it had not counted,
    its backup is seeded again over a new connection, nothing is restored, and the job ends equal to one left alone."""
    monkeypatch.setenv("TOWERFLOW_PS_LINK", "zmq")
    killed, alone, output = _killed_and_left_alone(tmp_path, ["--ps", "2", "--workers", "1"], 40, "dense",
                                                   "10:cut0,25:cut1")
    assert killed["global_step"] == alone["global_step"] == 40
    assert torch.equal(killed["variables"]["0.weight"], alone["variables"]["0.weight"])
    _assert_equal(killed["ps_state"], alone["ps_state"], "ps_state")
    recoveries = killed["recoveries"]
    # one recovery per cut, or one for both when the worker saw the two together (a fast machine: the second cut
    # can come before the first is noticed)
    seen = sorted(t for r in recoveries for t in (r["ps_task"] if isinstance(r["ps_task"], list) else [r["ps_task"]]))
    assert seen == [0, 1] and all(r["reconnected"] for r in recoveries), output
    assert output.count("had not stopped (its heartbeats went on): connected again") == len(recoveries), output
    assert "restarting it" not in output and "restored" not in output


def test_a_ps_task_that_stops_answering_is_replaced_by_its_backup_and_nothing_is_lost(tmp_path, monkeypatch):
    """ps task 1 of three freezes (SIGSTOP: a host that stops answering) and is not restarted: once ZeroMQ's
    heartbeats give it up and the promotion wait passes, its backup (ps task 2) serves its part, with a mirror of it
    on ps task 0, and training goes on, for longer than a restart may take (the chief naps while worker 1 waits on
    the ps: nobody waits for the frozen task any more); when it is killed and restarted, the chief gives the part
    back to it from the backup, ps task 0 lets go of the mirror it held of the part, and the job ends equal, update
    for update, to one left alone."""
    monkeypatch.setenv("TOWERFLOW_PS_LINK", "zmq")  # steps and replication over TCP, where a silent peer is noticed
    monkeypatch.setenv("TOWERFLOW_HEARTBEAT_TIMEOUT", "4")
    monkeypatch.setenv("TOWERFLOW_JOIN_TIMEOUT", "8")  # a lost task is given up after 4 + 8 s of silence
    monkeypatch.setenv("TOWERFLOW_PS_PROMOTE_AFTER", "2")
    killed, alone, output = _killed_and_left_alone(tmp_path, ["--ps", "3", "--workers", "2", "--mode", "sync"], 40,
                                                   "dense", "5:stop1,15:nap15,25:1+wait")
    assert killed["global_step"] == alone["global_step"] == 40, output
    assert output.count("restarting it") == 1 and "/job:ps/task:1 (pid" in output, output  # no worker failed
    _assert_equal(killed["variables"], alone["variables"], "variables")
    _assert_equal(killed["ps_state"], alone["ps_state"], "ps_state")
    promoted, back = killed["recoveries"] if len(killed["recoveries"]) == 2 else pytest.fail(output)
    assert promoted["promoted"] == [1] and promoted["steps_lost"] == 0, output
    assert back["from_mirrors"] and back["steps_lost"] == 0, output
    assert "promoted its mirror of /job:ps/task:1's part" in output and "its part is served by its backup" in output
    assert "gives /job:ps/task:1's part of 'model' back" in output, output
    assert "drops its mirror of /job:ps/task:1's part of 'model@1'" in output, output


def test_a_worker_that_prefetches_loses_no_update_when_ps_tasks_are_killed(tmp_path, monkeypatch):
    """`prefetch=True` (the next values pulled while the worker computes: one push more in flight), steps and
    replication over TCP: each killed ps task comes back from its mirror with every push the worker could not send
    again, and the job counts every push once, as the run left alone does. The values differ from that run's: a
    restore drops the values fetched ahead, so the next step computes on newer ones."""
    monkeypatch.setenv("REPLICA_TRAIN_PREFETCH", "1")
    monkeypatch.setenv("TOWERFLOW_PS_LINK", "zmq")
    killed, alone, output = _killed_and_left_alone(tmp_path, ["--ps", "2", "--workers", "1"], 40, "dense", "10:0,25:1")
    assert killed["global_step"] == alone["global_step"] == 40, output
    for task in (0, 1):
        mine, theirs = killed["ps_state"]["ps"][task], alone["ps_state"]["ps"][task]
        assert mine["clocks"] == theirs["clocks"] == {0: 40}, output
        steps = [s["step"] for s in mine["optimizer"]["state"].values()]
        assert steps and all(float(step) == 40 for step in steps), steps  # Adam applied each push once
    assert [r["ps_task"] for r in killed["recoveries"]] == [0, 1], output
    assert all(r["from_mirrors"] and r["steps_lost"] == 0 for r in killed["recoveries"]), killed["recoveries"]


def _out_of_restarts_and_left_alone(tmp_path, flags, steps, model, kills):
    """The job launched with `--max-restarts 0` and `kills`, beside the same job left alone (with restarts, which it
    never uses); (killed run's final, reference final, killed run's output)."""
    os.makedirs(tmp_path / "killed")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        alone = pool.submit(_launch, flags, tmp_path / "alone", steps, model, "none")
        output = launch([*flags, "--ps-replicas", "2", "--max-restarts", "0", HELPER, str(tmp_path / "killed"),
                         str(steps), model, kills], TIMEOUT)
        alone.result()
    return _final(tmp_path / "killed"), _final(tmp_path / "alone"), output


def test_a_ps_task_with_no_restarts_left_is_left_to_its_backup_and_the_job_ends_well(tmp_path, monkeypatch):
    """`--max-restarts 0`: the launcher leaves killed ps task 1 lost instead of ending the job; the workers, seeing
    that it will not be restarted, promote its backup once its heartbeats have stopped for the promotion wait, and
    the job exits 0 equal, update for update, to one left alone."""
    monkeypatch.setenv("TOWERFLOW_PS_PROMOTE_AFTER", "2")
    killed, alone, output = _out_of_restarts_and_left_alone(tmp_path, ["--ps", "2", "--workers", "2", "--mode", "sync"],
                                                            30, "sparse", "10:1")
    assert killed["global_step"] == alone["global_step"] == 30, output
    _assert_equal(killed["variables"], alone["variables"], "variables")
    _assert_equal(killed["tables"], alone["tables"], "tables")
    assert "restarting it" not in output and "leaving it lost" in output, output
    assert "/job:ps/task:1 had no restarts left and was left lost: its backup served its part" in output, output
    (record,) = killed["recoveries"]
    assert record["promoted"] == [1] and record["steps_lost"] == 0, output


def test_two_ps_tasks_lost_for_good_one_after_the_other_lose_nothing(tmp_path, monkeypatch):
    """Three ps tasks, `--max-restarts 0`: ps task 0 is killed and its part promoted on ps task 1, which seeds a
    backup of it on ps task 2; then ps task 1 is killed too, and ps task 2 serves all three parts to the end, which
    is equal, update for update, to the job left alone (a dense head, a fixed table and a hash vocabulary)."""
    monkeypatch.setenv("TOWERFLOW_PS_PROMOTE_AFTER", "2")
    killed, alone, output = _out_of_restarts_and_left_alone(tmp_path, ["--ps", "3", "--workers", "1"], 40, "tables",
                                                            "10:0,25:1")
    assert killed["global_step"] == alone["global_step"] == 40, output
    _assert_equal(killed["variables"], alone["variables"], "variables")
    _assert_equal(killed["tables"], alone["tables"], "tables")
    _assert_equal(killed["ps_state"], alone["ps_state"], "ps_state")
    assert output.count("leaving it lost") == 2 and "restarting it" not in output, output
    assert "promoted its mirror of /job:ps/task:0's part of 'model' (in place of ps:0)" in output, output
    assert "promoted its mirror of /job:ps/task:0's part of 'model' (in place of ps:1)" in output, output
    assert "promoted its mirror of /job:ps/task:1's part of 'model' (in place of ps:1)" in output, output
    assert [r["promoted"] for r in killed["recoveries"]] == [[0], [0, 1]] or pytest.fail(output)
    assert all(r["steps_lost"] == 0 for r in killed["recoveries"]), killed["recoveries"]
