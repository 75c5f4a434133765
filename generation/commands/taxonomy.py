"""`medbanana taxonomy`: the modalities, labels and edit targets, with the region each edit is placed in."""

from __future__ import annotations

from ..taxonomy import DIRECTIONS, load_taxonomy
from ..failures import EXIT_OK


def cmd_taxonomy(args) -> int:
    tax = load_taxonomy()
    for mod in tax.modalities.values():
        print(f"{mod.key} ({mod.display}): {len(mod.labels)} labels, {len(mod.targets)} edit targets")
        for label in mod.labels:
            role = "target" if label.edit_target else "label only"
            print(f"  {label.folder:<28} {role:<10} {label.region_text}")
    print(f"{len(tax.labels)} labels, {len(tax.targets)} edit targets, directions: {', '.join(DIRECTIONS)}")
    return EXIT_OK


def register(sub) -> None:
    p = sub.add_parser("taxonomy", help="list modalities, labels, edit targets and their regions",
                       description="List the 3 modalities, their labels (CheXpert-style chest X-ray findings, brain "
                                   "MRI tumour types, ODIR fundus diseases) with the folder name each uses in "
                                   "SOURCES/{D}/{Disease}/, which labels are edit targets, and the anatomical "
                                   "region an edit of each is placed in.")
    p.set_defaults(func=cmd_taxonomy)
