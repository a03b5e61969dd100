"""A trained run out of towerflow: its checkpoint as a plain PyTorch `state_dict` and Parquet tables.

`export_run(RUN_DIR, OUT)` (the `towerflow export` command) reads a checkpoint of any parameter-server
layout and writes what plain PyTorch and a serving store read (docs/serving.md).
"""

from towerflow.export.exporter import ExportInfo, export_run, read_export
from towerflow.export.saved_run import SavedRun, open_run

__all__ = ["ExportInfo", "SavedRun", "export_run", "open_run", "read_export"]
