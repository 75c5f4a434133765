"""README.md of a built dataset: `dataset_card.md` (package data) filled with this build's real statistics; and
`build_info`, what medbanana-build.json says beside it.

The statistics section is the paper's Table 1, Table 2 (with the most frequent failure reasons) and Figure 3, as
`medbanana stats` writes them (`paper.card_section`). The YAML front matter is serialised by the
libraries that read it (`datasets`' `DatasetInfosDict` and `MetadataConfigs`, `huggingface_hub`'s
`DatasetCardData`) from the same `CONFIG_FEATURES` the parquet files use. Every value that comes from the data
(run, dataset, modality, disease names, verdict reasons, marks read from images) goes through `md_escape`.
"""

from __future__ import annotations

import copy
import html
import re
import unicodedata
from collections import Counter
from importlib import resources
from string import Template

from ..generation.dataset.configs import DEFAULT_CONFIG
from ..generation.dataset.features import CONFIG_DESCRIPTIONS, CONFIG_FEATURES
from ..generation.dataset.folder import BUILD_INFO
from ..generation.masks import MASK_METHOD, RECOMPUTE
from ..generation.outcomes import TaskStatus
from ..generation.rundir.alignment import alignment_note
from ..generation.rundir.provenance import IPTC_DST_PREFIX, SOURCE_TYPES
from ..generation.rundir.stored_masks import COMPUTED, MISSING, REGION_REJECTED, REJECTED, STORED
from .cost_note import cost_json, cost_note
from .paper import card_section
from .stats import UNMARKED, BuildStats

PRETTY_NAME = "Med-Banana-style medical image edits (medbanana build)"
_SIZE_BINS = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
              (10_000_000, "1M<n<10M"))


# Markdown's inline syntax (code, emphasis, links, images, headings, escapes); `|` and HTML go as references.
# A run of `_` between two letters or digits cannot open or close emphasis (CommonMark's flanking rule), so
# names like brain_mri stay as they are.
_MARKDOWN_CHARS = re.compile(r"[\\`*~\[\]#!]|_+")


def md_escape(value) -> str:
    """A data value (disease, dataset or run name, reason, model id, ...) as inert Markdown text: one line, no HTML,
    no code span, link, emphasis or table cell break. Every data value in the card goes through this; values
    are never put inside backticks, where escapes do not apply."""
    text = "".join(" " if unicodedata.category(c) in ("Cc", "Zl", "Zp") else c for c in str(value))
    text = html.escape(_MARKDOWN_CHARS.sub(lambda m: _escape_run(m, text), text), quote=False)
    return text.replace("|", "&#124;")  # a reference: GFM splits table cells even on `\|` inside code


def _escape_run(match: re.Match, text: str) -> str:
    before, after = text[match.start() - 1:match.start()], text[match.end():match.end() + 1]
    if match.group().startswith("_") and before.isalnum() and after.isalnum():
        return match.group()
    return "".join("\\" + c for c in match.group())


def card_template() -> str:
    return (resources.files("medbanana") / "dataset_card.md").read_text(encoding="utf-8")


def split_pattern(config: str, split: str) -> str:
    return f"{config}/{split}-*.parquet"


def front_matter(stats: BuildStats, present: dict[str, list[str]]) -> str:
    """YAML for the configs that have rows (`present`: config -> its non-empty splits)."""
    from datasets.info import DatasetInfo, DatasetInfosDict
    from datasets.splits import SplitDict, SplitInfo
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCardData

    modalities = sorted({m for (m, _t, _d, _s) in stats.tasks if m != "unknown"})
    total = stats.total_tasks()
    card = DatasetCardData(
        license=["cc-by-4.0", "odc-by"], language=["en"], pretty_name=PRETTY_NAME,
        task_categories=["image-to-image", "image-text-to-text"],
        tags=["medical", "medical-imaging", "image-editing", "preference", "dpo", "synthetic",
              *(m.replace("_", "-") for m in modalities)],
        size_categories=[next((label for limit, label in _SIZE_BINS if total < limit), "n>10M")])
    infos, metadata = {}, {}
    default = DEFAULT_CONFIG if DEFAULT_CONFIG in present else next(iter(present))
    for config, splits in present.items():
        split_dict = SplitDict()
        for split in splits:
            split_dict.add(SplitInfo(name=split, num_bytes=stats.row_bytes[(config, split)],
                                     num_examples=stats.rows[(config, split)]))
        on_disk = sum(stats.shard_bytes[(config, split)] for split in splits)
        infos[config] = DatasetInfo(features=CONFIG_FEATURES[config], splits=split_dict, download_size=on_disk,
                                    dataset_size=sum(stats.row_bytes[(config, split)] for split in splits))
        metadata[config] = {"data_files": [{"split": s, "path": split_pattern(config, s)} for s in splits],
                            **({"default": True} if config == default else {})}
    DatasetInfosDict(infos).to_dataset_card_data(card)
    MetadataConfigs(metadata).to_dataset_card_data(card)
    return card.to_yaml() + "\n"


def render_card(stats: BuildStats, configs: list[str], present: dict[str, list[str]], *, max_rounds: int,
                test_fraction: float, sources: dict | None, build_note: str, figure: str | None,
                signing: dict[str, int] | None = None, acceptance: str = "",
                destinations: dict[str, list | None] | None = None) -> str:
    """`configs`: what was asked for; `present`: those with rows -> their non-empty splits; `sources`: how many
    tasks got their source image (`BuildStats.source_counts`), None when none were asked for; `figure`: Figure
    3's file name beside the card, or None when it was not drawn; `acceptance`: the section on the acceptance rule
    and expert approval (builder/acceptance.py); `destinations`: run name -> what it records of where its images
    went (runs.recorded_destinations)."""
    splits = ["train", "test"] if test_fraction > 0 else ["train"]
    accepted, failed, api_failed = (stats.total_tasks(s) for s in TaskStatus)
    attempts = sum(stats.attempts.values())
    runs = {run for (run, _d, _m) in stats.datasets}
    summary = (f"This build holds **{stats.total_tasks():,} tasks** from {len(runs)} run(s): {accepted:,} accepted "
               f"edits, {failed:,} tasks never accepted, {api_failed:,} stopped by API failures, and "
               f"{attempts:,} attempts in all.")
    pairs = sum(stats.rows[("dpo_pairs", s)] for s in splits)
    no_pair = ", ".join(f"{n:,} {md_escape(why)}" for why, n in sorted(stats.no_pair.items())) or "none"
    values = {
        "front_matter": front_matter(stats, present), "pretty_name": PRETTY_NAME,
        "max_rounds": max_rounds, "summary": summary,
        "configs_table": _configs_table(stats, configs, splits), "load_examples": _load_examples(list(present)),
        "empty_note": _empty_note(configs, present, splits),
        "source_note": _source_note(sources),
        "mask_note": mask_note(stats.mask_origins, sources),
        "alignment_note": alignment_note(stats.alignment, sources),
        "split_note": (f"Splits: `test` holds about {test_fraction:.0%} of the source images, chosen by a hash of "
                       "the source id, so that no source image is in both splits." if test_fraction > 0 else
                       "Splits: everything is in `train`."),
        "paper_section": paper_section(stats, figure), "rounds_table": _rounds_table(stats),
        "disease_table": _disease_table(stats), "mark_note": _mark_note(stats) + signing_note(signing, len(runs)),
        "pair_count": f"{pairs:,}" if "dpo_pairs" in configs else "not built",
        "no_pair_text": no_pair,
        "missing_note": (f"**Missing images:** {stats.missing_images:,} image files named by the run's JSON were not "
                         "found; their rows have a null image." if stats.missing_images else ""),
        "datasets_table": "\n".join(f"| {md_escape(run)} | {md_escape(dataset)} | {md_escape(modality)} | {n:,} |"
                                     for (run, dataset, modality), n in sorted(stats.datasets.items())),
        "build_note": build_note, "acceptance_note": acceptance,
        "destinations_note": destinations_note(destinations or {}),
        "cost_note": cost_note(stats, md_escape),
    }
    return Template(card_template()).substitute(values)


def mask_note(origins: Counter, sources: dict | None) -> str:
    """What the mask columns hold in this build (`origins`: stored_masks' counts of the attempt images' edit masks by
    where they came from), how they were computed and how to recompute them."""
    how = (f"Masks are computed by medbanana from the images, not drawn by annotators ({MASK_METHOD}); recompute "
           f"or vary them with `{RECOMPUTE}`.")  # our own constant: no data in it
    stored, computed, missing = origins[STORED], origins[COMPUTED], origins[MISSING]
    rejected = [f"{n:,} stored {what} mask{'s' if n != 1 else ''}" for n, what in
                ((origins[REJECTED], "edit"), (origins[REGION_REJECTED], "region")) if n]
    refusal = (f" The build rejected {' and '.join(rejected)} (not a binary PNG mask of the image's size, or too "
               "large; listed in medbanana-build.json) and computed or left null those instead." if rejected else "")
    if not stored and not computed:
        hint = "" if sources is not None else " (build with `--source-images DIR` to compute them)"
        return (f"In this build they are null: the runs stored no {'usable ' if rejected else ''}masks, and a mask "
                f"needs the source image to be computed{hint}.{refusal} " + how)
    told = [f"{stored:,} were stored by the run when it wrote each image"] if stored else []
    if computed:
        told.append(f"{computed:,} were computed at build time from source and edit")
    if missing:
        told.append(f"{missing:,} are null (no usable stored mask, and no source image to compute one from)")
    return (f"Of the attempt images' edit masks, {'; '.join(told)}. `edit_mask` is null where an attempt has no image, "
            "and `region_mask` where the task has neither a stored region nor its source image." + refusal + " " + how)


def _source_note(sources: dict | None) -> str:
    """Completes "`source_image` is ...": attached only as far as it is."""
    if sources is None:
        return "null: source images are not redistributed with this build."
    matched, total = sources["matched"], sources["total"]
    if matched == total:
        return f"attached from the builder's source folder, for all {total:,} tasks."
    return (f"attached from the builder's source folder for {matched:,} of {total:,} tasks ({matched / total:.0%}); "
            f"null for the other {total - matched:,}, whose source image that folder did not have.")


def _configs_table(stats: BuildStats, configs: list[str], splits: list[str]) -> str:
    return "\n".join(f"| {f'`{c}`' if i == 0 else ''} | {s} | {stats.rows[(c, s)]:,} | "
                     f"{CONFIG_DESCRIPTIONS[c] if i == 0 else ''} |"
                     for c in configs for i, s in enumerate(splits))


def _empty_note(configs: list[str], present: dict[str, list[str]], splits: list[str]) -> str:
    """datasets cannot load an empty split, so empty ones are not declared; say which and why."""
    empty = [f"`{c}` {s}" for c in configs for s in splits if s not in present.get(c, [])]
    if not empty:
        return ""
    return (f"Empty in this build, hence not declared in `configs:` (datasets cannot load an empty split): "
            f"{', '.join(empty)}.")


def _load_examples(configs: list[str]) -> str:
    return "\n".join(f'{c} = load_dataset("<this repo or folder>", "{c}", split="train")' for c in configs)


def _rounds_table(stats: BuildStats) -> str:
    by_round = Counter()
    for (_m, _t, r), n in stats.success_rounds.items():
        by_round[r if r is not None else "unknown"] += n
    total = sum(by_round.values()) or 1
    return "\n".join(f"| {md_escape(r)} | {n:,} | {n / total:.1%} |"
                     for r, n in sorted(by_round.items(), key=lambda kv: str(kv[0]).zfill(8)))


def _disease_table(stats: BuildStats) -> str:
    by_disease: dict[tuple, Counter] = {}
    for (modality, direction, disease, status), n in stats.tasks.items():
        by_disease.setdefault((modality, direction, disease), Counter())[status] += n
    return "\n".join(f"| {md_escape(m)} | {md_escape(t)} | {md_escape(d)} | "
                     + "".join(f"{c[status]:,} | " for status in TaskStatus).rstrip()
                     for (m, t, d), c in sorted(by_disease.items()))


def paper_section(stats: BuildStats, figure: str | None) -> str:
    """Table 1, Table 2 with the failure reasons, and Figure 3 when drawn: the markdown `medbanana stats` writes,
    made from a copy of `stats` whose texts (modality, direction, reasons) are escaped for the card."""
    return card_section(_escaped_texts(stats), figure).rstrip("\n")


def _escaped_texts(stats: BuildStats) -> BuildStats:
    """`stats` with `md_escape`d text in the keys that `card_section` prints (its tables escape only `|`)."""
    escaped = copy.copy(stats)
    escaped.tasks = Counter()
    for (m, t, d, status), n in stats.tasks.items():
        escaped.tasks[(md_escape(m), md_escape(t), md_escape(d), status)] += n
    escaped.success_rounds = Counter()
    for (m, t, r), n in stats.success_rounds.items():
        escaped.success_rounds[(md_escape(m), md_escape(t), r)] += n
    escaped.rejection_texts, escaped.reason_counts = Counter(), Counter()
    for reason, n in stats.failure_reasons.items():
        escaped.reason_counts[md_escape(reason)] += n
    return escaped


_MARK_MEANINGS = {  # the IPTC definitions, and which medbanana editor writes each
    "compositeSynthetic": "real content combined with non-trained synthetic elements (medbanana's offline "
                          "simulator)",
    "compositeWithTrainedAlgorithmicMedia": "real content changed by a trained model (an image-editing model)",
}


def _mark_note(stats: BuildStats) -> str:
    """What the edited images of this build carry, counted from their bytes."""
    marked = {t: n for t, n in stats.image_marks.items() if t != UNMARKED}
    read = stats.image_files_read
    if not read:
        return ("This build holds no image files (no image config was built), so none were counted; "
                "medbanana's generator marks every edited image it writes.")
    # known IPTC codes in code spans; any other value read from an image's XMP is data, escaped
    lines = [(f"- `{IPTC_DST_PREFIX}{t}`" if t in SOURCE_TYPES else f"- {md_escape(IPTC_DST_PREFIX + t)}")
             + f": {n:,} images" + (f", {_MARK_MEANINGS[t]}" if t in _MARK_MEANINGS else "")
             for t, n in sorted(marked.items())]
    unmarked = stats.image_marks[UNMARKED]
    if not unmarked:
        head = f"In this build **every one of the {read:,} edited images** carries the mark:"
    else:
        head = (f"In this build {read - unmarked:,} of the {read:,} edited images carry the mark; **{unmarked:,} "
                "carry none** (images not written by medbanana's generator, such as the files of the original "
                "Med-Banana-50K release): they are synthetic all the same.")
        head += " The marked ones:" if lines else ""
    return "\n".join([head, "", *lines]) if lines else head


def signing_note(signing: dict[str, int] | None, runs: int) -> str:
    """The card's paragraph on C2PA Content Credentials ('' when no run signed its images, so an unsigned build's
    card is as before). `signing`: certificate SHA-256 -> runs signed with it."""
    if not signing:
        return ""
    signed = sum(signing.values())
    certificates = "\n".join(f"- `{fingerprint}` ({n} run(s))" for fingerprint, n in signing.items())
    return (
        "\n\n**Signed Content Credentials (C2PA).** "
        + ("The runs behind this build signed every image they wrote" if signed >= runs else
           f"{signed} of the {runs} runs behind this build signed every image they wrote; the others did not")
        + ": each carries a C2PA manifest (actions `c2pa.created` and `c2pa.edited` with the IPTC digital source "
        "type, the model ids, and an `org.medbanana.provenance` assertion with the run id, task uid, round and the "
        "SHA-256 of the instruction and of the source image, never the source itself) whose signature covers the "
        "image bytes: one changed pixel makes it invalid, a stripped manifest shows as missing. Signing "
        "certificate SHA-256 fingerprint(s):\n\n" + certificates + "\n\n"
        "Check them with `medbanana verify DIR --c2pa --trust CA.pem` (`pip install 'medbanana[c2pa]'`; CA.pem is "
        "the publisher's CA certificate: compare its signing certificate's fingerprint with the one above), with "
        "`c2patool IMAGE.jpg`, or in Python with c2pa-python: `c2pa.Reader(\"image/jpeg\", io.BytesIO(data))"
        ".get_validation_state()` is `Valid` (`Trusted` when the CA is given as a trust anchor).")


def destinations_note(by_run: dict[str, list | None]) -> str:
    """Per run and destination, the data-use classes of the source images sent there (generation/destinations.py:
    local, cloud-no-retention or cloud; credentialed, open, unknown or synthetic), every value escaped."""
    rows = [f"| {md_escape(run)} | {md_escape(' and '.join(map(str, e.get('roles') or ())))} | "
            f"{md_escape(e.get('where'))} ({md_escape(e.get('backend'))}) | {md_escape(e.get('class'))}"
            f"{' (attested)' if e.get('attested') is True else ''} | "
            f"{md_escape(', '.join(map(str, e.get('data_use') or ())) or 'not recorded')} |"
            for run, entries in sorted(by_run.items()) for e in entries or ()]
    silent = sorted(run for run, entries in by_run.items() if not entries)
    note = (f"{len(silent)} run(s) recorded no destinations (made before medbanana recorded them): "
            f"{', '.join(md_escape(run) for run in silent[:5])}{' ...' if len(silent) > 5 else ''}." if silent else "")
    if not rows:
        return note or "No run behind this build recorded where its images went."
    return ("Each run records where the writer, editor and judge sent the source images and the data-use classes "
            "those images had (as the sources folder's manifest declared them; a user can mislabel data):\n\n"
            "| run | roles | destination | class | data-use classes sent |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + (f"\n\n{note}" if note else ""))


def partial_note(partial: dict[str, dict]) -> str:
    """The card's sentence on runs merged from an incomplete set of shards (`merge --partial`; empty when none):
    `partial` maps a run's name to its `{"of": N, "merged": [i, ...]}`."""
    if not partial:
        return ""
    runs = "; ".join(f"{md_escape(name)} holds shards {', '.join(map(str, s['merged'])) or 'none'} of {s['of']}"
                     for name, s in sorted(partial.items()))
    return (f" **Partial:** built from run(s) merged from an incomplete set of shards (`medbanana merge --partial`): "
            f"{runs}; the tasks of the missing shards are not in this build.")


def refused_note(stats: BuildStats) -> str:
    """The card's sentence on inputs left out under `--unsafe skip` (empty when none were)."""
    if not stats.refusals:
        return ""
    reasons = ", ".join(f"{n:,} {kind}" for kind, n in sorted(stats.refused.items()))
    return (f" Refused inputs left out of this build: {len(stats.refusals):,} ({reasons}), "
            f"{stats.refused_tasks:,} task(s); each is listed under stats.refused in {BUILD_INFO}.")


def coerced_note(stats: BuildStats) -> str:
    """The card's sentence on judge values read as booleans though they were not one (empty when none were)."""
    coerced = stats.coerced()
    if not coerced:
        return ""
    scores = coerced.pop("score", None)
    fields = ", ".join(f"{n['count']:,} `{name}`" for name, n in coerced.items())
    booleans = f" Judge values that were neither a boolean nor a yes/no word were read as booleans: {fields};" \
        if fields else ""
    scores = f" Judge scores that were no number were read as the number they spell, or null: {scores['count']:,} " \
        f"`score`;" if scores else ""
    return f"{booleans}{scores} listed under stats.coerced in {BUILD_INFO}."


def build_info(units, configs, splits, files, stats: BuildStats, test_fraction, max_shard_bytes,
               sources: dict | None, figure: str | None, unsafe: str = "error", destinations=None,
               partial: dict | None = None) -> dict:
    """What medbanana-build.json holds: versions, runs, options, rows and files per config, statistics."""
    import datasets

    from .. import __version__

    runs: dict[str, list[str]] = {}
    for unit in units:
        runs.setdefault(unit.run_dir.name, []).append(f"{unit.kind}:{unit.path.name}")
    return {"format_version": 1, "medbanana_version": __version__, "datasets_version": datasets.__version__,
            "runs": runs, "test_fraction": test_fraction, "max_shard_bytes": max_shard_bytes,
            # claimed only when every task got its source; `sources` counts them (null: none were asked for)
            "sources_attached": sources is not None and 0 < sources["matched"] == sources["total"],
            "sources": sources, "figure": figure, "unsafe": unsafe, "destinations": destinations or {},
            "partial_runs": partial or {},  # run name -> the shards it holds, for runs merged with --partial
            "mask_method": MASK_METHOD if stats.mask_origins[STORED] or stats.mask_origins[COMPUTED] else None,
            "configs": {c: {s: {"rows": stats.rows[(c, s)], "files": files.get(c, {}).get(s, [])} for s in splits}
                        for c in configs},
            "stats": stats.to_json(), "cost": cost_json(stats)}
