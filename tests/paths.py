"""Where things are, for a test at any depth under tests/ (tests/ is on sys.path through conftest.py)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository, which is the medbanana package
SHARED_SAMPLES = ROOT.parent / "shared" / "samples"  # released Med-Banana samples beside the clone, when present
