"""The cluster protocol's model (benchmarks/_scaling_model.py) checked against the measured scaling runs, then run
at 1,000 and 10,000 tasks on the embedded store (TCPStore) and on etcd. docs/scaling.md reads it.

    PYTHONPATH=src .venv/bin/python benchmarks/scaling_sim.py \
        [--calibration benchmarks/results/store_calibration_2026-12-05.json] [--host RUN.json] [--out FILE]

Checked against: the store calls per second (client-counted calls plus the beats), the keys per second where a run
counted them, the store host's CPU, and the detection times of benchmarks/results/scaling*.json; each row gives
model / measured and the error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _scaling_model as model  # noqa: E402

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
]


WINDOWED = {("scaling_window_2026-12-05.json", "after"), ("scaling_window_512_2026-12-05.json", "after")}


def _err(model_value: float, measured: float) -> float:
    return 100.0 * (model_value - measured) / measured if measured else float("nan")


def host_calibration(run_path: Path, tcpstore: dict) -> dict:
    """What one task spends of a core, from the smallest run in a scaling JSON (medians over its tasks), and the
    store client's CPU per check call and key from the store calibration (when it measured it)."""
    run = min(json.loads(run_path.read_text())["runs"], key=lambda r: r["tasks"])
    out = {"source": f"{run_path.name}: N={run['tasks']}", "task_cpu": run["task_cpu_steady_pct"] / 100,
           "post_meet_cpu": run["post_meet_cpu_ms"] / 1000}
    fit = tcpstore.get("check_client_cpu_us_fit")
    if fit:
        out["client_check_cpu"] = (1e-6 * fit["per_call"], 1e-6 * fit["per_key"])
    return out


def host_of(run: dict, calibration: dict, cores: float) -> model.Host:
    """The measured runs' machine: every task on its `cores`, each spending what the calibration run (a size where
    no task waits for a core) measured, and the store's client CPU per check call and key."""
    fit = calibration.get("client_check_cpu", (0.0, 0.0))
    return model.Host(cores=cores, tasks=run["tasks"], task_cpu=calibration["task_cpu"],
                      post_meet_cpu=calibration["post_meet_cpu"], client_check_cpu=tuple(fit))


def check(costs: model.StoreCosts, timeout: float = 5.0, host: dict = None, cores: float = 2.0) -> list:
    """Model against every measured run of 16 tasks or more (`host`: the shared machine's calibration, for the
    join; without it the protocol alone)."""
    out = []
    for name, variant, group, batched, steady_s, batched_tick in MEASURED:
        path = RESULTS / name
        if not path.exists():
            continue
        for r in json.loads(path.read_text())["runs"]:
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
            join = model.join_after_last_start(n, model.store_latency(join_load, costs)[1],
                                               host=host_of(r, host, cores) if host else None,
                                               store_cpu=costs.cpu(join_load))
            row = {"run": f"{name}:{variant}", "tasks": n, "group_watch": g, "clean_window": clean,
                   "calls_model": round(calls), "calls_measured": round(r["store_ops_s"]),
                   "calls_err_pct": round(_err(calls, r["store_ops_s"]), 1),
                   "cpu_pct_model": [round(100 * c, 2) for c in costs.cpu_range(load)],
                   "cpu_pct_measured": r["store_host_cpu_pct"],
                   "cpu_in_range": costs.cpu_range(load)[0] <= r["store_host_cpu_pct"] / 100 <= costs.cpu_range(load)[1],
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", default=str(RESULTS / "store_calibration_2026-12-05.json"))
    ap.add_argument("--out", default=str(RESULTS / "scaling_sim_2026-12-05.json"))
    ap.add_argument("--ps-per", type=int, default=100, help="one ps task per this many tasks at 1,000 and 10,000")
    ap.add_argument("--host", default=str(RESULTS / "scaling_host_calibration_2026-12-05.json"),
                    help="a benchmarks/scaling.py run at a size where no task waits for a core: what a task spends")
    ap.add_argument("--cores", type=float, default=2.0, help="the cores the measured runs' tasks shared")
    args = ap.parse_args(argv)
    cal = json.loads(Path(args.calibration).read_text())
    stores = {"tcpstore": model.StoreCosts.from_calibration(cal["tcpstore"])}
    if "etcd" in cal:
        stores["etcd"] = model.StoreCosts.from_calibration(cal["etcd"])
    host = host_calibration(Path(args.host), cal["tcpstore"]) if Path(args.host).exists() else None
    checked = check(stores["tcpstore"], host=host, cores=args.cores)
    print("| run | N | watch | calls/s model / measured (err %) | keys/s model / measured | store CPU % model (back to "
          "back – each call waking) / measured | detect med s model / measured | join after last start s model / measured |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in checked:
        keys = f"{c['keys_model']:,} / {c['keys_measured']:,} ({c['keys_err_pct']:+.0f}%)" if "keys_model" in c else "—"
        print(f"| {c['run']} | {c['tasks']} | {'group' if c['group_watch'] else 'direct'} | {c['calls_model']:,} / "
              f"{c['calls_measured']:,} ({c['calls_err_pct']:+.0f}%) | {keys} | {c['cpu_pct_model'][0]}–"
              f"{c['cpu_pct_model'][1]} / {c['cpu_pct_measured']} | {c['detect_med_model']} / {c['detect_med_measured']} "
              f"({c['detect_med_err_pct']:+.0f}%) | {c['join_model']} / {c['join_measured']} ({c['join_err_pct']:+.0f}%) |")
    predictions = {}
    for store, costs in stores.items():
        predictions[store] = {"rows": [], "saturates_at": {}}
        for n in (1000, 10000):
            for group in (False, True):
                p = model.predict(n, max(1, n // args.ps_per), costs, group=group)
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
                  f"{p['store_keys_s']:,.0f} | {p['store_cpu_s'][0]:.2f}–{p['store_cpu_s'][1]:.2f} | {1e3 * p['call_latency_s']:.2f} | "
                  f"{d['med']:.2f} / {d['max']:.2f} | {p['join_after_last_start_s']:.2f} ({p['join_peak_util']:.2f}) |")
        print(f"| {store} saturates (one core) at | direct N ≈ {pred['saturates_at']['direct']:,}, group watch N ≈ "
              f"{pred['saturates_at']['group']:,} | | | | | | | |")
    Path(args.out).write_text(json.dumps({"calibration": args.calibration, "checked": checked,
                                          "predictions": predictions}, indent=1, default=str))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
