"""The cluster protocol's model (benchmarks/_scaling_model.py, with the join simulated by _scaling_join.py) checked
against the measured scaling runs, then run at 1,000 and 10,000 tasks on the embedded store (TCPStore) and on etcd.
docs/scaling.md reads it.

    PYTHONPATH=src .venv/bin/python benchmarks/scaling_sim.py [--calibration STORE.json] [--calibration-shared BUSY.json] \
        [--polls POLLS.json] [--out FILE]

Its inputs are calibrations, none of them the runs it is checked on: the store's costs (store_calibration.py
--load), a waiting poll's CPU (poll_calibration.py) and a task's own CPU (a size of the judged scaling.py invocation
where no task waits for a core: its repeats go round with the judged sizes', so that a drift in the machine's speed
falls on both, and it is never judged itself). Checked against: the store calls per second (client-counted calls plus the beats), the keys
per second, the store host's CPU, the detection times and the join after the last start of
benchmarks/results/scaling*.json; each row gives model / measured and the error, and JUDGED's runs are compared
by the median of each size's repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _scaling_model as model  # noqa: E402
from _scaling_join import JoinCosts, simulate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# (file, variant, which protocol ran, whether the done set's changes were read in a batch, the run's steady
# window s, whether a watch tick was one batched read); WINDOWED: the runs whose join polls asked about a window of
# the missing keys (rendezvous.CHECK_WINDOW) rather than all of them
MEASURED = [
    ("scaling_by_method_2026-11-29.json", "after/direct", False, True, 5.0, False),
    ("scaling_by_method_2026-11-29.json", "after/group", True, True, 5.0, False),
    ("scaling_by_method_2026-11-29.json", "before/direct", False, False, 5.0, False),
    ("scaling_by_method_2026-11-29.json", "before/group", True, False, 5.0, False),
    ("scaling_messaging.json", "new", False, False, 5.0, False),
    ("scaling_messaging_128.json", "new", False, False, 5.0, False),
    ("scaling_group_watch_2026-11-29.json", "old", False, False, 5.0, False),
    ("scaling_group_watch_2026-11-29.json", "new", None, False, 5.0, False),
    ("scaling_group_watch_40_2026-11-29.json", "new", None, False, 3.0, False),
    ("scaling_direct_vs_group_2026-11-29.json", "new/direct", False, True, 5.0, False),
    ("scaling_direct_vs_group_2026-11-29.json", "new/group", True, True, 5.0, False),
    ("scaling_512_2026-11-29.json", "new", None, True, 3.0, False),
    ("scaling_batched_tick_2026-11-29.json", "before", None, True, 5.0, False),
    ("scaling_batched_tick_2026-11-29.json", "after", None, True, 5.0, True),
    ("scaling_no_exit_256_2026-11-29.json", "new/direct", False, True, 5.0, True),
    ("scaling_no_exit_256_2026-11-29.json", "new/group", True, True, 5.0, True),
    ("scaling_failures_read_2026-12-05.json", "before", None, True, 5.0, True),
    ("scaling_failures_read_2026-12-05.json", "after", None, True, 5.0, True),
    ("scaling_failures_read_512_2026-12-05.json", "before", None, True, 3.0, True),
    ("scaling_failures_read_512_2026-12-05.json", "after", None, True, 3.0, True),
    ("scaling_join_names_2026-12-05.json", "before", None, True, 3.0, True),
    ("scaling_join_names_2026-12-05.json", "after", None, True, 3.0, True),
    ("scaling_resolver_1s_2026-12-05.json", "new", None, True, 3.0, True),
    ("scaling_window_2026-12-05.json", "before", None, True, 3.0, True),
    ("scaling_window_2026-12-05.json", "after", None, True, 3.0, True),
    ("scaling_window_512_2026-12-05.json", "before", None, True, 3.0, True),
    ("scaling_window_512_2026-12-05.json", "after", None, True, 3.0, True),
    ("scaling_hosts_named_2026-12-05.json", "new", None, True, 3.0, True),
    ("scaling_interleaved_2026-12-05.json", "new", None, True, 10.0, True),
    ("scaling_one_call_polls_2026-12-05.json", "before", None, True, 10.0, True),
    ("scaling_one_call_polls_2026-12-05.json", "after", None, True, 10.0, True),
]


WINDOWED = {("scaling_window_2026-12-05.json", "after"), ("scaling_window_512_2026-12-05.json", "after"),
            ("scaling_hosts_named_2026-12-05.json", "new"), ("scaling_interleaved_2026-12-05.json", "new"),
            ("scaling_one_call_polls_2026-12-05.json", "before"), ("scaling_one_call_polls_2026-12-05.json", "after")}


def _err(model_value: float, measured: float) -> float:
    return 100.0 * (model_value - measured) / measured if measured else float("nan")


def host_calibration(run_path: Path, polls_path: Path, variant: str) -> dict:
    """What one task spends of a core, from the runs of the smallest size in a scaling JSON that uses the group watch
    as the judged sizes do (a size where none waits for a core; medians over the runs of each one's median task),
    and a waiting poll's CPU by how many processes poll at once (poll_calibration.py)."""
    runs = [r for r in json.loads(run_path.read_text())["runs"]
            if model.uses_group_watch(r["tasks"]) and r.get("variant") == variant]
    smallest = [r for r in runs if r["tasks"] == min(r["tasks"] for r in runs)]
    polls = json.loads(polls_path.read_text())["rows"]

    def med(field: str) -> float:
        return statistics.median(r[field] for r in smallest)

    def work(field: str, with_polls: str) -> float:  # without the waits' polls where the runs tell them apart
        return med(field) if all(not math.isnan(r.get(field, math.nan)) for r in smallest) else med(with_polls)

    return {"source": f"{run_path.name}: N={smallest[0]['tasks']} x {len(smallest)}; {polls_path.name}",
            "tasks": smallest[0]["tasks"], "task_cpu": med("task_cpu_steady_pct") / 100,
            "meet_cpu": work("meet_work_cpu_ms", "meet_cpu_ms") / 1000,
            "post_meet_cpu": work("post_meet_work_cpu_ms", "post_meet_cpu_ms") / 1000,
            "poll_cpu": [(r["tasks"], 1e-6 * r["poll_cpu_us_med"]) for r in polls]}


def join_costs(n: int, host: dict, costs: model.StoreCosts, processes: int) -> JoinCosts:
    """The join's costs for `n` tasks with `processes` of them on each host (the poll's CPU as calibrated with as
    many polling), the store's from its calibration: a poll is one call about a window of the missing keys."""
    window = min(n, model.CHECK_WINDOW)
    check = costs.cpu_call["check"], costs.cpu_key["check"]
    return JoinCosts(meet_cpu=host["meet_cpu"], post_meet_cpu=host["post_meet_cpu"],
                     poll_cpu=model.log_interpolated(host["poll_cpu"], processes), task_cpu=host["task_cpu"],
                     poll_store=1e-6 * (check[0] + check[1] * window),
                     post_store=1e-6 * model.JOIN_ROUND_TRIPS * costs.cpu_call["add"])


def check(costs: model.StoreCosts, timeout: float = 5.0, host: dict = None, cores: float = 2.0,
          shared: model.StoreCosts = None) -> list:
    """Model against every measured run of 16 tasks or more (`host`: the shared machine's calibration, for the
    join; without it the protocol alone)."""
    out = []
    for name, variant, group, batched, steady_s, batched_tick in MEASURED:
        path = RESULTS / name
        if not path.exists():
            continue
        measured = json.loads(path.read_text())
        # whether its joins carry the name resolver's timeouts (docs/cluster.md): unknown before it was probed
        resolver_s = measured["meta"].get("resolver_lookup_max_s")
        for r in measured["runs"]:
            n = r["tasks"]
            if r.get("variant") != variant or n < 16:
                continue
            g = model.uses_group_watch(n) if group is None else group
            load = model.steady_load(n, 1, g, batched_tick=batched_tick)
            clean = "store_by_method" in r  # the steady window starts after every task is up
            # the ps says it is done once it serves: every task rereads the done set once within the window (which,
            # before the steady mark, began at each task's own up and held the rest of the join too)
            window = steady_s if clean else steady_s + max(0.0, r["join_all_s"] - r["join_med_s"]) + 1.0
            load = model.merged(load, model.scaled(model.done_reread(n, n, 1, batched), 1.0 / window))
            calls, keys = model.total(load)
            beats = n / model.BEAT_EVERY
            util, latency = model.store_latency(load, costs)
            d = model.detection(n, timeout, latency, g)
            poll_window = model.CHECK_WINDOW if (name, variant) in WINDOWED else None
            join_load = model.merged(load, model.join_poll_load(n, n // 2, poll_window))
            cpu = (shared or costs).cpu_loaded(load)[0]  # the store on the tasks' machine, as busy as they make it
            join = (simulate(n, join_costs(n, host, costs, n), cores, shared=True, store_steady=cpu)
                    if host else model.join_after_last_start(n, model.store_latency(join_load, costs)[1]))
            row = {"run": f"{name}:{variant}", "tasks": n, "group_watch": g, "clean_window": clean,
                   "resolver_lookup_max_s": resolver_s,
                   "calls_model": round(calls), "calls_measured": round(r["store_ops_s"]),
                   "calls_err_pct": round(_err(calls, r["store_ops_s"]), 1),
                   "cpu_pct_model": [round(100 * c, 2) for c in costs.cpu_range(load)],
                   "cpu_pct_measured": r["store_host_cpu_pct"],
                   "cpu_in_range": costs.cpu_range(load)[0] <= r["store_host_cpu_pct"] / 100 <= costs.cpu_range(load)[1],
                   "cpu_pct_loaded_model": round(100 * cpu, 2),
                   "cpu_loaded_err_pct": round(_err(100 * cpu, r["store_host_cpu_pct"]), 1),
                   "detect_med_model": round(d["med"], 2), "detect_med_measured": r["detect_med_s"],
                   "detect_med_err_pct": round(_err(d["med"], r["detect_med_s"]), 1),
                   "detect_max_model": round(d["max"], 2), "detect_max_measured": r["detect_max_s"],
                   "detect_max_err_pct": round(_err(d["max"], r["detect_max_s"]), 1),
                   "join_model": round(join, 2), "join_measured": r["join_after_start_s"],
                   "join_err_pct": round(_err(join, r["join_after_start_s"]), 1),
                   "machine_busy_pct": r["machine_busy_pct"]}
            if "store_keys_s" in r:
                row.update(keys_model=round(keys - beats), keys_measured=round(r["store_keys_s"]),
                           keys_err_pct=round(_err(keys - beats, r["store_keys_s"]), 1))
            out.append(row)
    return out


# the runs the model is judged on: the current code, the name resolver answering (every join without its timeouts)
JUDGED_FILE, JUDGED_VARIANT = "scaling_one_call_polls_2026-12-05.json", "after"
JUDGED = f"{JUDGED_FILE}:{JUDGED_VARIANT}"
COMPARED = (("calls", "store calls/s"), ("keys", "keys/s"), ("cpu", "store CPU %"), ("detect_med", "detect med s"),
            ("join", "join after last start s"))


def by_size(checked: list, run: str = JUDGED, calibrated_at: Optional[int] = None) -> list:
    """The model against the median of a run's repeats at each size but the one its host calibration came from
    (`calibrated_at`): {tasks, repeats, <what>_model, <what>_measured, <what>_err_pct} for each of COMPARED."""
    out = []
    for n in sorted({c["tasks"] for c in checked if c["run"] == run} - {calibrated_at}):
        rows = [c for c in checked if c["run"] == run and c["tasks"] == n]
        row = {"tasks": n, "repeats": len(rows)}
        for what, _ in COMPARED:
            model_key = "cpu_pct_loaded_model" if what == "cpu" else f"{what}_model"
            measured_key = "cpu_pct_measured" if what == "cpu" else f"{what}_measured"
            if model_key not in rows[0]:
                continue
            modelled, measured = rows[0][model_key], statistics.median(r[measured_key] for r in rows)
            row.update({f"{what}_model": modelled, f"{what}_measured": measured,
                        f"{what}_err_pct": round(_err(modelled, measured), 1)})
        out.append(row)
    return out


def _seconds(value) -> str:
    if value is None:
        return "—"
    return "over 120" if math.isinf(value) else f"{value:.2f}"


def _cores(figure: tuple) -> str:
    """A store CPU figure under load: one number within the calibrated rates, else its range."""
    low, high = figure
    return f"{low:.2f}" if abs(high - low) < 1e-9 else f"{low:.2f}–{high:.2f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", default=str(RESULTS / "store_calibration_load_2026-12-05.json"),
                    help="store_calibration.py --load on a quiet machine: the store on a host of its own")
    ap.add_argument("--calibration-shared", default=str(RESULTS / "store_calibration_load_busy_one_call_2026-12-05.json"),
                    help="store_calibration.py --load --task-cpu-pct P: the store sharing its machine with the tasks, "
                         "as in the measured runs (P: the host calibration's task_cpu_steady_pct)")
    ap.add_argument("--out", default=str(RESULTS / "scaling_sim_one_call_polls_2026-12-05.json"))
    ap.add_argument("--ps-per", type=int, default=100, help="one ps task per this many tasks at 1,000 and 10,000")
    ap.add_argument("--host", default=str(RESULTS / JUDGED_FILE),
                    help="a benchmarks/scaling.py run whose smallest size using the group watch says what a task "
                         "spends (not judged): by default the judged runs' own, their repeats interleaved with it")
    ap.add_argument("--polls", default=str(RESULTS / "poll_calibration_one_call_2026-12-05.json"),
                    help="benchmarks/poll_calibration.py's JSON: a waiting poll's CPU by how many poll at once")
    ap.add_argument("--cores", type=float, default=2.0, help="the cores the measured runs' tasks shared")
    args = ap.parse_args(argv)
    cal = json.loads(Path(args.calibration).read_text())
    stores = {"tcpstore": model.StoreCosts.from_calibration(cal["tcpstore"])}
    if "etcd" in cal:
        stores["etcd"] = model.StoreCosts.from_calibration(cal["etcd"])
    host = host_calibration(Path(args.host), Path(args.polls), JUDGED_VARIANT) if Path(args.host).exists() else None
    shared = (model.StoreCosts.from_calibration(json.loads(Path(args.calibration_shared).read_text())["tcpstore"])
              if Path(args.calibration_shared).exists() else None)
    checked = check(stores["tcpstore"], host=host, cores=args.cores, shared=shared)
    print("| run | N | watch | calls/s model / measured (err %) | keys/s model / measured | store CPU % model under load / "
          "measured (bounds: back to back – each call waking) | detect med s model / measured | join after last start s "
          "model / measured |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in checked:
        keys = f"{c['keys_model']:,} / {c['keys_measured']:,} ({c['keys_err_pct']:+.0f}%)" if "keys_model" in c else "—"
        print(f"| {c['run']} | {c['tasks']} | {'group' if c['group_watch'] else 'direct'} | {c['calls_model']:,} / "
              f"{c['calls_measured']:,} ({c['calls_err_pct']:+.0f}%) | {keys} | {c['cpu_pct_loaded_model']} / "
              f"{c['cpu_pct_measured']} ({c['cpu_loaded_err_pct']:+.0f}%; {c['cpu_pct_model'][0]}–{c['cpu_pct_model'][1]}) | "
              f"{c['detect_med_model']} / {c['detect_med_measured']} "
              f"({c['detect_med_err_pct']:+.0f}%) | {c['join_model']} / {c['join_measured']} ({c['join_err_pct']:+.0f}%) |")
    judged = by_size(checked, calibrated_at=host["tasks"] if host else None)
    print(f"\nThe model against the median of each size's runs ({JUDGED}):\n")
    print("| N | runs | " + " | ".join(f"{label} model / measured (err)" for _, label in COMPARED) + " |")
    print("| --- | --- |" + " --- |" * len(COMPARED))
    for row in judged:
        cells = [f"{row[f'{w}_model']:,} / {row[f'{w}_measured']:,} ({row[f'{w}_err_pct']:+.0f}%)" if f"{w}_model" in row
                 else "—" for w, _ in COMPARED]
        print(f"| {row['tasks']} | {row['repeats']} | " + " | ".join(cells) + " |")
    predictions = {}
    for store, costs in stores.items():
        predictions[store] = {"rows": [], "saturates_at": {}}
        for n in (1000, 10000):
            for group in (False, True):
                p = model.predict(n, max(1, n // args.ps_per), costs, group=group)
                if host:  # a host per task: each its own core, the store a host of its own; the polls as with few
                    smallest = min(k for k, _ in host["poll_cpu"])
                    p["join_sim_s"] = simulate(n, join_costs(n, host, costs, smallest), cores=n, shared=False,
                                               store_steady=min(1.0, p["store_util"]), limit=120.0)
                predictions[store]["rows"].append(p)
        for group in (False, True):
            predictions[store]["saturates_at"]["group" if group else "direct"] = model.break_point(costs, group, args.ps_per)
    print("\n| store | N | check | store calls/s | keys/s | store CPU (cores) | call latency ms | detect med / max s | "
          "join after last start s (peak util) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for store, pred in predictions.items():
        for p in pred["rows"]:
            d = p["detect"]
            print(f"| {store} | {p['tasks']:,} | {'group' if p['group_watch'] else 'direct'} | {p['store_calls_s']:,.0f} | "
                  f"{p['store_keys_s']:,.0f} | {_cores(p['store_cpu_loaded_s'])} (bounds {p['store_cpu_s'][0]:.2f}–"
                  f"{p['store_cpu_s'][1]:.2f}) | {1e3 * p['call_latency_s']:.2f} | "
                  f"{d['med']:.2f} / {d['max']:.2f} | {_seconds(p.get('join_sim_s'))} ({p['join_peak_util']:.2f}) |")
        print(f"| {store} saturates (one core) at | direct N ≈ {pred['saturates_at']['direct']:,}, group watch N ≈ "
              f"{pred['saturates_at']['group']:,} | | | | | | | |")
    Path(args.out).write_text(json.dumps({"calibration": args.calibration, "host": host, "checked": checked, "judged": judged,
                                          "predictions": predictions}, indent=1, default=str))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
