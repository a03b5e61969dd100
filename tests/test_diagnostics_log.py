"""The diagnostics channel: one format with the task's name, the placement log's own lines left alone."""

import logging

from towerflow import _log


def test_a_record_names_its_task_else_the_process_task(capsys):
    _log.configure("/job:worker/task:3")
    _log.get("cluster", "/job:ps/task:0").info("waiting for /job:worker/task:0 — 1 of 2 tasks up")
    _log.get("session").warning("went on")
    logging.getLogger("towerflow.placement").info("op -> /job:localhost/task:0/device:CPU:0")
    err = capsys.readouterr().err
    assert "towerflow: /job:ps/task:0: waiting for /job:worker/task:0 — 1 of 2 tasks up\n" in err
    assert "towerflow: /job:worker/task:3: went on\n" in err
    assert "device:CPU:0" not in err  # the placement log prints through its own handler, when turned on


def test_configuring_twice_keeps_one_handler_and_the_root_logger_alone():
    root = list(logging.getLogger().handlers)
    _log.configure()
    _log.configure("launcher")
    handlers = [h for h in logging.getLogger("towerflow").handlers if isinstance(h, logging.StreamHandler)]
    assert len(handlers) == 1 and logging.getLogger().handlers == root


def test_a_user_who_configured_logging_sees_each_line_once_in_their_format(capsys):
    import sys

    _log.configure("/job:worker/task:3")
    mine = logging.StreamHandler(sys.stderr)
    mine.setFormatter(logging.Formatter("MINE %(name)s: %(message)s"))
    logging.getLogger().addHandler(mine)
    try:
        _log.get("session").warning("went on")
    finally:
        logging.getLogger().removeHandler(mine)
    _log.get("session").warning("and on")
    err = capsys.readouterr().err
    assert err.count("went on") == 1 and "MINE towerflow.session: went on" in err
    assert "towerflow: /job:worker/task:3: and on\n" in err  # without theirs, towerflow's own handler again
