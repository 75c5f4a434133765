"""The run directory, the on-disk contract: its names (`layout`), the journal and JSON files (`store`), the writer's
lock, the synthetic-content mark on every image (`provenance`) and the merge of shard runs."""
