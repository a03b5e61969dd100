"""benchmarks/scaling.py's numbers: one run's summary, and the table of medians over repeats."""

from __future__ import annotations

import statistics
from typing import Dict, List

MB = 1 << 20


def _pct(values: List[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _med(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def _rate(end: dict, a: str, b: str, index: int = 1) -> float:
    """A task's store calls (index 1) or CPU seconds (index 2) per second between two of its phase marks."""
    ma, mb = end["marks"].get(a), end["marks"].get(b)
    if not ma or not mb or mb[0] <= ma[0]:
        return float("nan")
    return (mb[index] - ma[index]) / (mb[0] - ma[0])


def _window(end: dict, a: str, b: str) -> Dict[str, List[float]]:
    """A task's {store method: [calls, keys]} made between two of its phase marks."""
    ma, mb = end.get("by_method", {}).get(a, {}), end.get("by_method", {}).get(b)
    if mb is None:
        return {}
    return {m: [c - ma.get(m, [0, 0])[0], k - ma.get(m, [0, 0])[1]] for m, (c, k) in mb.items()
            if (c, k) != tuple(ma.get(m, [0, 0]))}


def _keys_rate(end: dict) -> float:
    """A task's keys named per second in the steady window (a multi_get of k keys counts k)."""
    dt = end["marks"]["fanin"][0] - end["marks"]["steady"][0] if {"fanin", "steady"} <= set(end["marks"]) else 0
    return sum(k for _, k in _window(end, "steady", "fanin").values()) / dt if dt > 0 else 0.0


def store_by_method(r: dict) -> dict:
    """Per task and summed over the cluster: the store calls and keys of each method, per second in the steady
    window (`steady`), and in all from the task's Server being up to the steady mark (`after_up`). The heartbeats
    (one `add` a second per task, from a thread that holds the store before it is counted) are not in it."""
    per_task, steady, after_up = [], {}, {}
    for e in sorted(r.get("ends", []), key=lambda e: e["rank"]):
        marks = e["marks"]
        dt = marks["fanin"][0] - marks["steady"][0] if {"fanin", "steady"} <= set(marks) else 0
        rates = {m: [round(c / dt, 2), round(k / dt, 2)] for m, (c, k) in _window(e, "steady", "fanin").items()} if dt > 0 else {}
        joined = _window(e, "up", "steady")
        st = e.get("sites", {})
        a, b = st.get("steady", {}), st.get("fanin", {})
        callers = {k: round((v - a.get(k, 0)) / dt, 2) for k, v in b.items() if v > a.get(k, 0)} if dt > 0 else {}
        per_task.append({"rank": e["rank"], "steady_per_s": rates, "after_up": joined, "callers_per_s": callers})
        for into, part in ((steady, rates), (after_up, joined)):
            for m, (c, k) in part.items():
                into.setdefault(m, [0.0, 0.0])
                into[m][0] += c
                into[m][1] += k
    rnd = lambda d: {m: [round(c, 1), round(k, 1)] for m, (c, k) in sorted(d.items())}  # noqa: E731
    return {"store_by_task": per_task, "store_by_method": {"steady_per_s": rnd(steady), "after_up": rnd(after_up)}}


def print_methods(r: dict) -> None:
    """The cluster's store calls and keys per method: per second in the steady window, and in all after up."""
    by = store_by_method(r)["store_by_method"]
    workers = [t for t in store_by_method(r)["store_by_task"] if t["rank"] != 0]
    print("| method | calls/s | keys/s | calls/s per worker (med) | keys/s per worker (med) | after up: calls | keys |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m in sorted(set(by["steady_per_s"]) | set(by["after_up"])):
        c, k = by["steady_per_s"].get(m, [0, 0])
        wc = _med(t["steady_per_s"].get(m, [0, 0])[0] for t in workers)
        wk = _med(t["steady_per_s"].get(m, [0, 0])[1] for t in workers)
        ac, ak = by["after_up"].get(m, [0, 0])
        print(f"| {m} | {c:.1f} | {k:.1f} | {wc:.2f} | {wk:.1f} | {ac:.0f} | {ak:.0f} |")


def summarize(r: dict) -> Dict[str, float]:
    """The scalar measurements of one run (times in s unless _ms, rates per s, memory in MB)."""
    n, ends, t0 = r["tasks"], r.get("ends", []), r["t0"]
    ups = r["ups"]
    workers = [e for e in ends if e["rank"] != 0]
    ps = [e for e in ends if e["rank"] == 0]
    calls = [_rate(e, "steady", "fanin") for e in ends]
    after_up = [_rate(e, "up", "steady") for e in ends if "up" in e["marks"]]
    calls_ok = [c for c in calls if c == c]
    beats = r["beats_per_task_s"]
    lat = [x for e in workers for x in e["lat"]]
    fanin_calls = sum(len(e["lat"]) / (e["marks"]["watch"][0] - e["marks"]["fanin"][0])
                      for e in workers if "watch" in e["marks"] and "fanin" in e["marks"])
    detect = [e["detected"] - r["t_kill"] for e in ends if "detected" in e]
    victim = f"/job:worker/task:{n - 2}"
    checks = [c for e in workers for c in e.get("checks", [])]
    s = {
        "join_all_s": r["all_up_s"],
        "spawn_s": max(u["start"] for u in ups) - t0,
        "join_after_start_s": max(u["up"] for u in ups) - max(u["imported"] for u in ups),
        "join_med_s": _med(u["up"] - t0 for u in ups),
        "meet_med_s": _med(u["meet_s"] for u in ups),
        "meet_max_s": max(u["meet_s"] for u in ups),
        "rpc_join_med_s": _med(u["join_rpc_s"] for u in ups),
        "rpc_join_max_s": max(u["join_rpc_s"] for u in ups),
        # a task's CPU from the end of its meet (every slot taken) until it is up: what each task still has to do
        # once the last one has started
        "post_meet_cpu_ms": 1000 * _med(u["cpu_up"] - u["cpu_met"] for u in ups) if all("cpu_met" in u for u in ups)
        else float("nan"),
        # its meet's CPU: connecting, claiming its slot, and polling until every slot is taken
        "meet_cpu_ms": 1000 * _med(u["cpu_met"] - u["cpu_imported"] for u in ups) if all("cpu_imported" in u for u in ups)
        else float("nan"),
        # the same two without their waits' polls (what the join simulation adds by itself): the meet until its slot
        # is claimed, and the part of the join from every slot taken until its up key is set
        "meet_work_cpu_ms": 1000 * _med(u["cpu_claimed"] - u["cpu_imported"] for u in ups)
        if all("cpu_claimed" in u for u in ups) else float("nan"),
        "post_meet_work_cpu_ms": 1000 * _med(u["cpu_joined"] - u["cpu_met"] for u in ups)
        if all("cpu_joined" in u for u in ups) else float("nan"),
        "store_ops_s": sum(calls_ok) * n / max(1, len(calls_ok)) + sum(beats),
        "ps_ops_s": calls[0] if ps and ps[0]["rank"] == 0 and calls else float("nan"),
        "worker_ops_s": _med(_rate(e, "steady", "fanin") for e in workers),
        "after_up_ops_s": _med(after_up) if after_up else float("nan"),
        "store_keys_s": sum(_keys_rate(e) for e in ends),
        "beats_med": _med(beats),
        "beats_min": min(beats) if beats else float("nan"),
        "check_ms": 1000 * _med(checks),
        "check_p90_ms": 1000 * _pct(checks, 0.9),
        "task_cpu_pct": 100 * _med(r["task_cpu_s"]),
        "task_cpu_steady_pct": 100 * _med(_rate(e, "steady", "fanin", 2) for e in ends),  # the task's own clock
        "store_host_cpu_pct": 100 * r["host_cpu_steady"],
        "store_host_cpu_join_pct": 100 * r["host_cpu_join"],
        "machine_busy_pct": 100 * r["machine_busy"],
        "probe_idle_ms": 1000 * _med(r["probe_idle"]),
        "probe_steady_ms": 1000 * _med(r["probe_steady"]),
        "probe_steady_p99_ms": 1000 * _pct(r["probe_steady"], 0.99),
        "rss_mb": _med(r["rss"]) / MB,
        "uss_mb": _med(r["uss"]) / MB,
        "store_host_rss_mb": r["host_rss"] / MB,
        "fanin_calls_s": fanin_calls,
        "fanin_p50_ms": 1000 * _pct(lat, 0.5),
        "fanin_p90_ms": 1000 * _pct(lat, 0.9),
        "fanin_p99_ms": 1000 * _pct(lat, 0.99),
        "ps_cpu_fanin_pct": 100 * r["ps_cpu_fanin"],
        "detected": len(detect),
        "detect_first_s": min(detect) if detect else float("nan"),
        "detect_med_s": _med(detect),
        "detect_max_s": max(detect) if detect else float("nan"),
        "named_victim": sum(1 for e in ends if e.get("lost") == victim or f"{victim} " in e.get("error", "")),
        "false_lost": sum(1 for e in ends if e.get("detected", r["t_kill"]) < r["t_kill"]),
        "load1_steady": r["load_steady"][0],
    }
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}


COLUMNS = [
    ("variant", "variant"), ("tasks", "N"), ("runs", "runs"),
    ("join_all_s", "all joined s"), ("join_after_start_s", "joined after last start s"), ("meet_med_s", "meet s"), ("rpc_join_max_s", "RPC join max s"),
    ("store_ops_s", "store ops/s"), ("worker_ops_s", "ops/s/worker"), ("ps_ops_s", "ops/s ps"),
    ("beats_min", "beats/s min"), ("check_ms", "check ms"), ("task_cpu_pct", "task CPU %"),
    ("store_host_cpu_pct", "store CPU %"), ("machine_busy_pct", "machine busy %"),
    ("probe_steady_ms", "store get ms"), ("detect_med_s", "detect med s"), ("detect_max_s", "detect max s"), ("false_lost", "lost before the kill"),
    ("fanin_calls_s", "fan-in calls/s"), ("fanin_p50_ms", "p50 ms"), ("fanin_p99_ms", "p99 ms"),
    ("rss_mb", "RSS MB"), ("uss_mb", "USS MB"), ("load1_steady", "load"),
]


def detections(r: dict) -> List[dict]:
    """Each survivor's notice of the loss, in the order they came: its rank, seconds after the kill, the task
    it named and the first words of its error (what a late or wrong notice looks like)."""
    out = [{"rank": e["rank"], "after_s": round(e["detected"] - r["t_kill"], 3), "lost": e.get("lost"),
            "error": (e.get("error") or "")[:160]} for e in r.get("ends", []) if "detected" in e]
    return sorted(out, key=lambda d: d["after_s"])


def print_table(runs: List[dict]) -> List[dict]:
    """Medians over the repeats of each (variant, N); printed as a Markdown table and returned."""
    groups: Dict[tuple, List[dict]] = {}
    for r in runs:
        groups.setdefault((r["variant"], r["tasks"]), []).append(summarize(r))
    rows = []
    for (variant, n), sums in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row = {"variant": variant, "tasks": n, "runs": len(sums)}
        for key in sums[0]:
            row[key] = round(_med(s[key] for s in sums), 3)
        rows.append(row)
    print("| " + " | ".join(h for _, h in COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(_fmt(row.get(k)) for k, _ in COLUMNS) + " |")
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"
    return str(v)
