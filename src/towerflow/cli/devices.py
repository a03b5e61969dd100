"""`towerflow devices [--json]`: the device mapping of this task, as TF prints it."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("devices", help="list the devices ops can be placed on")
    p.add_argument("--json", action="store_true", help="print the devices as a JSON list")
    p.set_defaults(func=run)


def run(args) -> int:
    from towerflow.devices import device_mapping, list_devices

    if args.json:
        print(json.dumps([d.as_dict() for d in list_devices()], indent=2))
    else:
        print(device_mapping())
    return 0
