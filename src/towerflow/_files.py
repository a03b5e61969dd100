"""Names of the files towerflow writes into a log directory, in one place."""

CHECKPOINT_GLOB = "ckpt-*.json"  # one manifest per checkpoint; the manifest is what makes it count


def checkpoint_file(step: int) -> str:
    return f"ckpt-{step:010d}.pt"


def manifest_file(step: int) -> str:
    return f"ckpt-{step:010d}.json"


METRICS_FILE = "metrics.jsonl"  # JSON lines appended by every task; read by `towerflow top` / `report`
RESULTS_FILE = "metrics.json"  # a run's final numbers (accuracy, global step, samples/s), written once at the end

# An export (`towerflow export RUN_DIR --out DIR`): the manifest is written last and makes the folder count.
EXPORT_MANIFEST = "export.json"
EXPORT_MODEL = "model.pt"  # the model's state_dict, tables included, for `model.load_state_dict(torch.load(...))`
EXPORT_HASH_TABLES = "hash_tables.pt"  # {table: {"ids", "weight"}} of the hash tables (HashTableLookup reads it)
EXPORT_HASH_LOOKUP = "hash_lookup.py"  # the plain-torch lookup module, copied beside them
EXPORT_TABLES_DIR = "tables"  # tables/NAME/part-00000.parquet: each table's (id, vector) rows, one file per shard


def export_table_file(table: str, shard: int) -> str:
    return f"{EXPORT_TABLES_DIR}/{table}/part-{shard:05d}.parquet"

# Published rows (`towerflow launch --publish-every S`): PUBLISH_DIR/MODEL/ps-T/ per ps task (ps/tables/delta_log.py).
PUBLISH_SUBDIR = "publish"  # under the logdir when --publish-to is not given
PUBLISH_MANIFEST = "manifest.json"  # the announced publications; a file it does not name does not count
PUBLISH_DENSE = "dense.parquet"
PUBLISH_EVICTED_SUFFIX = ".evicted.parquet"  # TABLE.evicted.parquet: a delta's ids of evicted hash rows


def publish_task_dir(task: int) -> str:
    return f"ps-{task}"


def publish_entry_dir(seq: int, kind: str) -> str:
    return f"{seq:08d}-{kind}"
