"""The dataset folder's contract, below the stages that write and read it: its configs (`configs.py`) and schemas
(`features.py`), its files' names and read contract (`folder.py`), the checksum manifest, what a build may replace
and the crash-safe swap into `--out` (`output.py`), a review folder's contract (`review_folder.py`)."""
