"""The configs of a built dataset, free of heavy imports, so that the command line lists them without importing
datasets; their schemas are in `features.py`."""

CONFIG_NAMES = ("sft", "failed", "dpo_pairs", "conversations", "judge")  # built from run directories
REVIEW_CONFIG = "human_review"  # built from `medbanana review` folders (`build --reviews`)
PUBLISHED_CONFIGS = (*CONFIG_NAMES, REVIEW_CONFIG)
DEFAULT_CONFIG = "sft"
