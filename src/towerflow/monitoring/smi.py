"""`towerflow smi`: a gpustat-like one-screen view of the GPUs, or of the CPU and RAM without one."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import sys
import time
from typing import Any, Dict, Optional, TextIO

from towerflow.monitoring import _screen
from towerflow.monitoring import nvml as _nvml

_RESET, _BOLD, _RED, _YELLOW, _GREEN, _CYAN = "\x1b[0m", "\x1b[1m", "\x1b[31m", "\x1b[33m", "\x1b[32m", "\x1b[36m"


def _paint(text: str, code: str, colour: bool) -> str:
    return f"{code}{text}{_RESET}" if colour else text


def host_stats() -> Dict[str, Any]:
    """CPU count, load and RAM from /proc (Linux) or what the platform offers elsewhere."""
    stats: Dict[str, Any] = {"cpus": os.cpu_count(), "cpu_model": platform.processor() or platform.machine()}
    try:
        stats["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        stats["load_avg"] = None
    meminfo = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                meminfo[key] = int(value.split()[0]) >> 10  # kB -> MiB
    except OSError:
        pass
    stats["ram_total_mib"] = meminfo.get("MemTotal")
    stats["ram_used_mib"] = (meminfo["MemTotal"] - meminfo["MemAvailable"]) if "MemAvailable" in meminfo else None
    return stats


def snapshot(nvml: Any = None) -> Dict[str, Any]:
    """Everything one screen shows, as plain data (the --json output)."""
    out: Dict[str, Any] = {"hostname": socket.gethostname(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        out["gpus"] = [dataclasses.asdict(g) for g in _nvml.query(nvml)]
        out["no_gpu_reason"] = None
    except _nvml.NVMLUnavailable as e:
        out["gpus"] = []
        out["no_gpu_reason"] = str(e)
    out["host"] = host_stats()
    return out


def _process_text(p: Dict[str, Any]) -> str:
    program = os.path.basename(p["command"].split()[0]) if p["command"] not in ("", "?") else "?"
    memory = f"({p['memory_mib']}M)" if p["memory_mib"] is not None else ""
    return f"{p['user']}:{program}/{p['pid']}{memory}"


def _gpu_line(g: Dict[str, Any], colour: bool) -> str:
    """gpustat's shape: `[0] Tesla T4 | 48'C,  0 % |  16 /  70 W |  0 / 15079 MB | user:python/1234(500M)`."""
    index = _paint("[{}]".format(g["index"]), _CYAN, colour)
    name = _paint("{:<20}".format(g["name"]), _BOLD, colour)
    temp = "{:>3}'C".format(g["temperature_c"]) if g["temperature_c"] is not None else "  ?'C"
    util = "{:>3} %".format(g["utilization_pct"]) if g["utilization_pct"] is not None else "  ? %"
    if g["power_w"] is not None and g["power_limit_w"]:
        power = "{:>4} / {:>3} W".format(g["power_w"], g["power_limit_w"])
    else:
        power = "     ? W"
    memory = "{:>6} / {:>6} MB".format(g["memory_used_mib"], g["memory_total_mib"])
    hot = g["temperature_c"] is not None and g["temperature_c"] >= 80
    busy = g["utilization_pct"] is not None and g["utilization_pct"] >= 50
    processes = " ".join(_process_text(p) for p in g["processes"])
    return (
        f"{index} {name} | {_paint(temp, _RED if hot else _YELLOW, colour)}, "
        f"{_paint(util, _GREEN, colour) if busy else util} | {power} | {_paint(memory, _YELLOW, colour)} | {processes}"
    ).rstrip()


def render(snap: Dict[str, Any], colour: bool = False) -> str:
    lines = [f"{_paint(snap['hostname'], _BOLD, colour)}  {snap['time']}"]
    if snap["gpus"]:
        lines += [_gpu_line(g, colour) for g in snap["gpus"]]
    else:
        lines.append(f"no GPU: {snap['no_gpu_reason']}")
    host = snap["host"]
    load = ", ".join(map(str, host["load_avg"])) if host["load_avg"] else "?"
    ram = (
        f"{host['ram_used_mib']} / {host['ram_total_mib']} MB"
        if host["ram_used_mib"] is not None
        else f"? / {host['ram_total_mib'] or '?'} MB"
    )
    lines.append(f"CPU  {host['cpu_model']} x{host['cpus']} | load {load} | RAM {ram}")
    return "\n".join(lines)


def run(watch: Optional[float] = None, as_json: bool = False, colour: Optional[bool] = None,
        out: TextIO = sys.stdout, nvml: Any = None, max_frames: Optional[int] = None) -> int:
    """Print one screen, or refresh it in place every `watch` seconds until Ctrl-C."""
    colour = out.isatty() if colour is None else colour

    def frame() -> str:
        snap = snapshot(nvml)
        return json.dumps(snap, indent=2) if as_json else render(snap, colour)

    return _screen.show(frame, out, watch, max_frames)
