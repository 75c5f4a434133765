"""Tiny synthesised dataset trees in each source dataset's own layout, for the prepare tests."""

from __future__ import annotations

import argparse
import io
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image

from medbanana.generation.commands import prepare as cli_prepare


def scan(seed: int, size=(120, 90), mode: str = "L") -> Image.Image:
    """A scan-like picture: a smooth blob plus seeded noise, distinct per seed, no uniform areas."""
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    cx, cy = rng.uniform(0.3, 0.7) * w, rng.uniform(0.3, 0.7) * h
    base = 60 + 150 * np.exp(-(((xx - cx) / (0.35 * w)) ** 2 + ((yy - cy) / (0.35 * h)) ** 2))
    grey = np.clip(base + rng.normal(0, 12, (h, w)), 1, 254).astype(np.uint8)
    if mode == "L":
        return Image.fromarray(grey)
    rgb = np.stack([grey, np.roll(grey, 3, axis=1), 255 - grey], axis=-1)
    return Image.fromarray(rgb).convert(mode)


def save(path: Path, image: Image.Image, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, **kw)
    return path


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height but holds almost no data (a decompression-limit probe)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + png_chunk(b"IEND", b""))


def png_with_chunk(image: Image.Image, kind: bytes, data: bytes) -> bytes:
    """`image` as a PNG with one more chunk right after IHDR (before the pixels, so Pillow reads it on open)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    png = buf.getvalue()
    return png[:33] + png_chunk(kind, data) + png[33:]  # signature 8 + IHDR 25


def dicom_bytes(pixels: np.ndarray, photometric: str, frames: int = 1, **header) -> bytes:
    """A DICOM file of 12-bit grey `pixels` with a patient name and id in its header (pydicom, the 'dicom' extra)."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = SecondaryCaptureImageStorage, generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.PatientName, ds.PatientID = "Doe^Jane", "MRN99887766"
    ds.Rows, ds.Columns = pixels.shape[-2:]
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    if frames > 1:
        ds.NumberOfFrames = frames
    for key, value in header.items():
        setattr(ds, key, value)
    ds.PixelData = pixels.astype(np.uint16).tobytes()
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


def snapshot(root: Path, skip: Path) -> dict:
    """(size, mtime) of every entry under root except `skip`, links not followed."""
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(folder, d) != skip]
        for name in files + dirs:
            st = os.lstat(Path(folder, name))
            out[str(Path(folder, name).relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def run_prepare_process(argv: list, timeout: float = 300) -> subprocess.CompletedProcess:
    """`medbanana prepare ARGV` in its own process, killed after `timeout` seconds (a hang fails the test)."""
    return subprocess.run([sys.executable, "-m", "medbanana", "prepare", *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout)


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="medbanana")
    cli_prepare.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["prepare", *map(str, argv)])
    return args.func(args)


# --- MIMIC-CXR-JPG --------------------------------------------------------------------------------------------
CHEXPERT_COLUMNS = ["subject_id", "study_id", "Atelectasis", "Cardiomegaly", "Consolidation", "Edema",
                    "Enlarged Cardiomediastinum", "Fracture", "Lung Lesion", "Lung Opacity", "No Finding",
                    "Pleural Effusion", "Pleural Other", "Pneumonia", "Pneumothorax", "Support Devices"]

# (subject, study, labels, [(dicom_id, view, on disk)])
MIMIC_STUDIES = [
    (10000001, 50000001, {"No Finding": 1, "Support Devices": 1}, [("d1pa", "PA", True), ("d1lat", "LATERAL", True)]),
    (10000002, 50000002, {"Pneumothorax": 1}, [("d2ap", "AP", True), ("d2pa", "PA", True)]),
    (10000003, 50000003, {"Pleural Effusion": 1, "Edema": 1}, [("d3", "PA", True)]),
    (10000004, 50000004, {"Cardiomegaly": -1}, [("d4", "AP", True)]),
    (10000005, 50000005, {"Edema": 1, "Atelectasis": -1}, [("d5", "PA", True)]),
    (10000006, 50000006, {"Consolidation": 1}, [("d6", "LATERAL", True)]),
    (10000007, 50000007, {"Fracture": 1}, [("d7", "PA", False)]),
    (10000008, 50000008, {"Pleural Other": 1}, [("d8", "PA", True)]),
    (11000009, 50000009, {"Lung Lesion": 1, "Pneumonia": 0}, [("d9", "AP", True)]),
]


def mimic_tree(root: Path, extra_columns: dict | None = None, drop_metadata_column: str | None = None) -> Path:
    rows, meta = [], []
    for seed, (subject, study, labels, images) in enumerate(MIMIC_STUDIES):
        rows.append({c: labels.get(c, "") for c in CHEXPERT_COLUMNS} | {"subject_id": subject, "study_id": study})
        for dicom, view, on_disk in images:
            meta.append({"dicom_id": dicom, "subject_id": subject, "study_id": study,
                         "PerformedProcedureStepDescription": "CHEST (PA AND LAT)", "ViewPosition": view,
                         "Rows": 90, "Columns": 120})
            if on_disk:
                save(root / "files" / f"p{str(subject)[:2]}" / f"p{subject}" / f"s{study}" / f"{dicom}.jpg",
                     scan(seed * 10 + len(dicom)), quality=90)
    table = pd.DataFrame(rows)
    for name, value in (extra_columns or {}).items():
        table[name] = value
    table.to_csv(root / "mimic-cxr-2.0.0-chexpert.csv.gz", index=False)
    meta_table = pd.DataFrame(meta)
    if drop_metadata_column:
        meta_table = meta_table.drop(columns=[drop_metadata_column])
    meta_table.to_csv(root / "mimic-cxr-2.0.0-metadata.csv.gz", index=False)
    return root


# --- Brain Tumor MRI (Kaggle) ----------------------------------------------------------------------------------
BRAIN_FILES = ["Training/glioma/Tr-gl_0001.jpg", "Training/glioma/Tr-gl_0002.jpg", "Training/notumor/Tr-no_0001.jpg",
               "Testing/meningioma_tumor/Te-me_0001.jpg", "Testing/pituitary/Te-pi_0001.jpg",
               "Testing/notumor/Te-noTr_0001.jpg", "Testing/mystery/x_0001.jpg"]


def brain_tree(root: Path) -> Path:
    for seed, rel in enumerate(BRAIN_FILES):
        save(root / rel, scan(100 + seed, size=(150 + 10 * seed, 120), mode="RGB"), quality=92)
    return root


# --- ODIR-5K ---------------------------------------------------------------------------------------------------
ODIR_ROWS = [  # ID, left keywords, right keywords, flags N D G C A H M O
    (0, "cataract", "normal fundus", "00010000"),
    (1, "moderate non proliferative retinopathy\uff0clens dust", "normal fundus", "01000000"),
    (2, "glaucoma\uff0ccataract", "suspected glaucoma", "00110000"),
    (3, "dry age-related macular degeneration", "no fundus image", "00000001"),
    (4, "pathological myopia", "pathological myopia", "00000010"),
    (5, "hypertensive retinopathy", "drusen", "00000101"),
]


def odir_table(extra_column: bool = False, drop: str | None = None) -> pd.DataFrame:
    rows = []
    for pid, left, right, flags in ODIR_ROWS:
        row = {"ID": pid, "Patient Age": 60, "Patient Sex": "Female", "Left-Fundus": f"{pid}_left.jpg",
               "Right-Fundus": f"{pid}_right.jpg", "Left-Diagnostic Keywords": left,
               "Right-Diagnostic Keywords": right}
        row |= dict(zip("NDGCAHMO", map(int, flags)))
        rows.append(row)
    rows[4]["Left-Fundus"] = "../4_left.jpg"  # a path, not a file name
    table = pd.DataFrame(rows)
    if extra_column:
        table["Reader notes"] = "x"
    if drop:
        table = table.drop(columns=[drop])
    return table


def odir_tree(root: Path, sheet: str = "csv", **table_kw) -> Path:
    images = root / "ODIR-5K" / "Training Images"
    for seed, (pid, *_rest) in enumerate(ODIR_ROWS):
        for eye in ("left", "right"):
            if (pid, eye) != (4, "right"):  # 4_right is listed but missing
                save(images / f"{pid}_{eye}.jpg", scan(200 + 2 * seed + (eye == "right"), (160, 120), "RGB"))
        save(root / "preprocessed_images" / f"{pid}_left.jpg", scan(999, (64, 64), "RGB"))  # same names, ignored
    save(images.parent / "4_left.jpg", scan(7, (100, 100)))  # what "../4_left.jpg" would reach from the images
    table = odir_table(**table_kw)
    if sheet == "xlsx":
        table.to_excel(root / "ODIR-5K_Training_Annotations(Updated)_V2.xlsx", index=False)
    else:
        table.to_csv(root / "full_df.csv", index=False)
    return root
