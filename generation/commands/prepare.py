"""The `medbanana prepare` command: its options and help, and the summary it prints (registered by generation/commands).

The work is the prepare stage, generation/sources/prepare.py; this module only turns arguments into its options and
its report into lines. Exit codes: 0 when the datasets hold prepared images, 1 when they hold none, 2 on a fatal input
problem (PrepareError).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..destinations import DATA_USE_CLASSES, MANIFEST
from ..records import DEFAULT_MAX_PIXELS
from ..sources.adapters import ADAPTERS, UNCERTAIN_POLICIES, AdapterOptions, PrepareError
from ..sources.prepare import REPORT, PrepareOptions, prepare
from ..sources.preprocess import ASPECTS, ImageOptions
from ..taxonomy import load_taxonomy
from ..vocabulary import DEFAULT_THREADS, old_spelling
from ..failures import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

HELP = """\
Turn a downloaded dataset into the generator's source layout, OUT/{D}/normal/*.jpeg and OUT/{D}/{Disease}/*.jpeg:
SIZE x SIZE RGB JPEG q95 (aspect kept by padding with black unless --aspect stretch), same bytes for the same
input. No metadata leaves with the pixels: EXIF, XMP, ICC, JPEG comments and DICOM headers are dropped (burned-in
text in the pixels is not detected: out of scope). OUT/prepare_manifest.jsonl lists every image (source id,
dataset, modality, labels, view, original path, content hash, size); OUT/prepare_report.json has one entry per
file skipped (unreadable, truncated, CMYK, too small or large, bad EXIF, PNG text bomb, duplicate content, FIFO
or other non-regular file, unsafe path, symlink loop, dangling symlink, folder linked out of ROOT), converted
(16-bit, alpha, EXIF orientation, DICOM window) or renamed (spaces, non-ASCII, too long); the run goes on.
DICOM files are named by content (dicom_<hash>): their input paths, which may hold patient names, are kept only
in OUT/prepare_private.jsonl and the report; do not publish those two files. Rerunning on the same OUT skips what
is done. Exit 0 when images were prepared (some files may be skipped), 1 when none was, 2 on a fatal problem.

Kinds:
  mimic-cxr        ROOT holds files/ and mimic-cxr-2.0.0-{chexpert,metadata}.csv(.gz). Frontal (PA/AP) images,
                   one per study (s<study_id>): normal = No Finding; a disease class = exactly one positive
                   finding, an edit target; uncertain (-1) labels per --uncertain; Support Devices ignored.
  brain-tumor-mri  ROOT holds Training/ and Testing/ with glioma, meningioma, pituitary, notumor (-> normal).
  odir             ROOT holds the annotation spreadsheet (xlsx needs openpyxl, or csv) and the images; one
                   source per eye, labelled from that eye's keywords when they name exactly one class.
  folders          ROOT/{D}/{normal,<Disease>}/ (images, or DICOM with pydicom), or one {D} folder.

Data use: each image's manifest line records its data-use class, which `generate` and `eval` check before any
image goes to a cloud service (docs/data-destinations.md): mimic-cxr is credentialed (PhysioNet's agreement: never
sent to a `cloud` destination), brain-tumor-mri and odir are open (with their licence), folders are unknown unless
--data-use says otherwise (a MIMIC-CXR DICOM folder: --data-use credentialed).

OUT then feeds `medbanana generate --sources OUT`.
"""


def register(subparsers) -> None:
    """Add `medbanana prepare` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "prepare", help="turn MIMIC-CXR-JPG, Brain Tumor MRI, ODIR-5K or full-data folders into generator sources",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=HELP)
    p.add_argument("kind", choices=sorted(ADAPTERS), help="dataset layout of ROOT")
    p.add_argument("root", type=Path, help="the downloaded dataset's folder")
    p.add_argument("--out", type=Path, required=True, help="output sources folder (created; rerun to resume)")
    p.add_argument("--name", help="output dataset folder name {D} (must imply the modality: mimic/chest, "
                                  "brain/tumor, odir/fundus; default per kind)")
    g = p.add_argument_group("selection")
    g.add_argument("--per-class", type=int, metavar="N", help="at most N images per class, drawn in a seeded order "
                                                              "(default: all)")
    g.add_argument("--seed", type=int, default=0, help="seed of the per-class order (default 0)")
    g.add_argument("--classes", nargs="+", metavar="C", default=(),
                   help="only these class folders (normal and released disease names, e.g. Pleural_Effusion)")
    g.add_argument("--uncertain", choices=UNCERTAIN_POLICIES, default="exclude",
                   help="MIMIC uncertain (-1) labels: exclude the study (default), read as negative, or positive")
    g.add_argument("--splits", nargs="+", default=("Training", "Testing"), help="Brain Tumor MRI splits to use")
    g.add_argument("--modality", choices=sorted(load_taxonomy().modalities),
                   help="folders: modality when the folder names do not tell")
    g.add_argument("--data-use", choices=DATA_USE_CLASSES, metavar="CLASS",
                   help="folders: the images' data-use class, one of " + ", ".join(DATA_USE_CLASSES) + " (default "
                        "unknown; credentialed for PhysioNet credentialed data such as MIMIC-CXR DICOM)")
    g.add_argument("--licence", metavar="TEXT", help="folders with --data-use open: the licence of the images")
    g.add_argument("--skip-unknown", action="store_true",
                   help="folders: leave out class folders whose name is not in the taxonomy (listed in the report); "
                        "by default such a folder, e.g. a misspelt Pleural_Efusion/, is an error naming the closest "
                        "class name")
    g = p.add_argument_group("label files")
    g.add_argument("--labels", type=Path, help="MIMIC CheXpert csv or ODIR spreadsheet (default: found in ROOT)")
    g.add_argument("--metadata", type=Path, help="MIMIC metadata csv (default: found in ROOT)")
    g.add_argument("--images", type=Path, help="ODIR image folder (default: ROOT's 'Training Images', else ROOT)")
    g = p.add_argument_group("images")
    g.add_argument("--size", type=int, default=1024, help="output side in pixels (default 1024)")
    g.add_argument("--aspect", choices=ASPECTS, default="pad",
                   help="pad: keep the aspect ratio, centre on black (default); stretch: scale each axis")
    g.add_argument("--quality", type=int, default=95, help="JPEG quality (default 95)")
    g.add_argument("--min-side", type=int, default=64, help="skip images whose shorter side is smaller (default 64)")
    g.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                   help=f"skip images with more pixels than this, read from the header before decoding (default "
                        f"{DEFAULT_MAX_PIXELS}, as `generate --max-pixels`; Pillow itself refuses more than twice "
                        "its default)")
    threads = g.add_argument("--threads", type=int, default=DEFAULT_THREADS, metavar="N",
                             help="threads decoding and encoding the images (default: one per CPU, at most 4)")
    old_spelling(g, threads, "--workers")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args) -> int:
    adapter_opts = AdapterOptions(name=args.name, labels=args.labels, metadata=args.metadata, images=args.images,
                                  uncertain=args.uncertain, splits=tuple(args.splits), modality=args.modality,
                                  skip_unknown=args.skip_unknown)
    image = ImageOptions(size=args.size, aspect=args.aspect, quality=args.quality, min_side=args.min_side,
                         max_pixels=args.max_pixels)
    opts = PrepareOptions(image=image, per_class=args.per_class, seed=args.seed, classes=tuple(args.classes),
                          workers=args.threads, quiet=args.quiet, data_use=args.data_use, licence=args.licence)
    try:
        sections = prepare(args.kind, args.root, args.out, adapter_opts, opts)
    except PrepareError as exc:
        print(f"medbanana prepare: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    total = 0
    for name, section in sections.items():
        if section.get("skipped"):
            print(f"{name}: {section['skipped']}")
            continue
        c = section["counts"]
        total += c["prepared_total"]
        classes = ", ".join(f"{k} {v}" for k, v in section["per_class"].items())
        print(f"{name} ({section['modality']}): {c['prepared_now']} prepared now, {c['prepared_total']} in total "
              f"[{classes}]; {c['skipped']} skipped, {c['converted']} converted, {c['renamed']} renamed")
        use = section["data_use"]
        print(f"  data use: {use['class']}" + (f" ({use['licence']})" if use["licence"] else ""))
        if section.get("shortfall"):
            print(f"  fewer than --per-class: {section['shortfall']}")
    print(f"sources: {args.out}  report: {args.out / REPORT}  manifest: {args.out / MANIFEST}")
    if not total:
        print("medbanana prepare: nothing was prepared; see the report", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
