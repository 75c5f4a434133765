"""Builder: run directories -> Hugging Face parquet configs, dataset card, manifest, upload.

The config names live here, free of heavy imports, so the command line can list them without importing datasets;
their schemas are in `features.py`.
"""

CONFIG_NAMES = ("sft", "failed", "dpo_pairs", "conversations", "judge")  # built from run directories
REVIEW_CONFIG = "human_review"  # built from `medbanana review` folders (`build --reviews`)
PUBLISHED_CONFIGS = (*CONFIG_NAMES, REVIEW_CONFIG)
DEFAULT_CONFIG = "sft"
