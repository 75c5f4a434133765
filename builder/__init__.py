"""Builder: run directories -> Hugging Face parquet configs, dataset card, manifest, upload.

The configs and their schemas are the dataset folder's contract (`generation/dataset/`), which readers share.
"""
