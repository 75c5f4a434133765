"""The MIMIC-CXR-JPG adapter of `medbanana prepare`: chest X-rays labelled from the CheXpert label table.

files/pXX/pNNNNNNNN/sNNNNNNNN/<dicom_id>.jpg (.dcm accepted) + mimic-cxr-2.0.0-chexpert.csv(.gz) and
mimic-cxr-2.0.0-metadata.csv(.gz). Frontal views only (ViewPosition PA or AP), one image per study (PA preferred,
then the smallest dicom_id), named s<study_id> as in the released data. Normal: No Finding = 1 and no finding
positive or uncertain. Single disease: exactly one of the 13 findings (12 CheXpert findings except No Finding and
Support Devices, i.e. the 11 edit targets plus Pleural Other) is positive, and it is an edit target. Uncertain (-1)
labels, `uncertain=`: "exclude" (default; a study with any uncertain finding is neither normal nor single-disease),
"negative" (-1 read as 0), "positive" (-1 read as 1). Blank means not mentioned (negative). Support Devices are
ignored.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ...taxonomy import Taxonomy
from .base import (SAFE_NAME, AdapterOptions, Candidate, DatasetSource, PrepareError, Problem, dataset_name,
                   find_label_file, link_problem, norm, read_table, table_columns)

MIMIC_FINDINGS = ("Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Enlarged Cardiomediastinum", "Fracture",
                  "Lung Lesion", "Lung Opacity", "Pleural Effusion", "Pleural Other", "Pneumonia", "Pneumothorax")
UNCERTAIN_POLICIES = ("exclude", "negative", "positive")


def mimic_cxr(root: Path, opts: AdapterOptions, tax: Taxonomy) -> list[DatasetSource]:
    if opts.uncertain not in UNCERTAIN_POLICIES:
        raise PrepareError(f"uncertain-label policy {opts.uncertain!r}; use one of {', '.join(UNCERTAIN_POLICIES)}")
    chexpert_path = find_label_file(root, opts.labels, ("mimic-cxr-2.0.0-chexpert.csv.gz",
                                                        "mimic-cxr-2.0.0-chexpert.csv"), "CheXpert label file",
                                    "--labels")
    meta_path = find_label_file(root, opts.metadata, ("mimic-cxr-2.0.0-metadata.csv.gz",
                                                      "mimic-cxr-2.0.0-metadata.csv"), "metadata file", "--metadata")
    src = DatasetSource(dataset_name(opts.name or "MIMIC_CXR_single_disease", "chest_xray", tax), "chest_xray",
                        "mimic-cxr", root)
    labels = read_table(chexpert_path)
    finding_cols = {norm(f): f for f in (*MIMIC_FINDINGS, "No Finding")}
    cols = table_columns(labels, chexpert_path, {"subjectid": "subject_id", "studyid": "study_id", **finding_cols},
                         {"supportdevices"}, src.problems)
    meta = read_table(meta_path)
    mcols = table_columns(meta, meta_path, {"dicomid": "dicom_id", "subjectid": "subject_id", "studyid": "study_id",
                                            "viewposition": "ViewPosition"}, set(map(norm, meta.columns)),
                          src.problems)
    frontal: dict[str, list[tuple[int, str, str]]] = {}  # study -> [(preference, dicom_id, view)]
    for dicom, study, view in zip(meta[mcols["dicomid"]], meta[mcols["studyid"]], meta[mcols["viewposition"]]):
        view = str(view).strip().upper()
        if view in ("PA", "AP") and SAFE_NAME.fullmatch(str(dicom)):  # ids become path parts: no separators
            frontal.setdefault(_int_text(study), []).append((view != "PA", str(dicom), view))
    counts = Counter()
    uncertain_value = {"exclude": "?", "negative": 0, "positive": 1}[opts.uncertain]
    for row in labels.itertuples(index=False):
        row = dict(zip(labels.columns, row))
        subject, study = _int_text(row[cols["subjectid"]]), _int_text(row[cols["studyid"]])
        values = {f: _chexpert_value(row[cols[norm(f)]], uncertain_value, study) for f in MIMIC_FINDINGS}
        positives = [f for f, v in values.items() if v == 1]
        if "?" in values.values():
            counts["excluded_uncertain"] += 1
            continue
        if not positives and _chexpert_value(row[cols["nofinding"]], uncertain_value, study) == 1:
            label = "normal"
        elif len(positives) == 1 and tax.find(positives[0], "chest_xray").edit_target:
            label = tax.find(positives[0], "chest_xray").folder
        else:
            counts["excluded_multiple_or_other" if positives else "excluded_no_label"] += 1
            continue
        if study not in frontal or not (subject.isdigit() and study.isdigit()):
            counts["excluded_no_frontal_view" if subject.isdigit() else "excluded_bad_subject_id"] += 1
            continue
        folder = root / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}"
        found = None
        for _, dicom, view in sorted(frontal[study]):
            found = next(((p, view) for p in (folder / f"{dicom}.jpg", folder / f"{dicom}.dcm")
                          if p.is_file() or p.is_symlink()), None)  # a broken link is reported, not "missing"
            if found:
                break
        if found is not None and (problem := link_problem(root, found[0])):
            src.problems.append(Problem(found[0].relative_to(root).as_posix(), problem))
            continue
        if found is None:
            counts["missing_on_disk"] += 1
            if counts["missing_on_disk"] <= 20:
                src.problems.append(Problem(folder.relative_to(root).as_posix(),
                                            "study selected by its labels but no frontal image of it is on disk"))
            continue
        path, view = found
        src.candidates.append(Candidate(path, path.relative_to(root).as_posix(), label, f"s{study}", view,
                                        tuple(positives) or ("No Finding",), f"p{subject}",
                                        {"subject_id": subject, "study_id": study, "dicom_id": path.stem},
                                        named_from_file=False))  # s<study_id>: from the de-identified table
    src.counts = dict(counts, uncertain_policy=opts.uncertain)
    return [src]


def _int_text(value) -> str:
    text = str(value).strip()
    return text[:-2] if text.endswith(".0") else text


def _chexpert_value(raw, uncertain_value, study: str):
    text = str(raw).strip()
    if text in ("", "nan", "NaN", "0", "0.0"):
        return 0
    if text in ("1", "1.0"):
        return 1
    if text in ("-1", "-1.0"):
        return uncertain_value
    raise PrepareError(f"CheXpert labels of study {study}: value {text!r} is not 1, 0, -1 or blank")
