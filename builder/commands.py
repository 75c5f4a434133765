"""Subcommands `build`, `upload`, `verify` and `stats` of the `medbanana` command (the root cli.py calls
`register`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..generation.dataset.configs import CONFIG_NAMES
from ..generation.vocabulary import old_spelling
from ..generation.rundir.confined import POLICIES
from ..generation.failures import EXIT_FAILURE, EXIT_OK, EXIT_USAGE


def register(subparsers) -> None:
    build = subparsers.add_parser(
        "build", help="build a Hugging Face dataset folder from run directories",
        description="Read one or more run directories (ours, or released Med-Banana data in the original scripts' "
                    "layout, or a records.jsonl of the paper's §5.2 schema) and write a dataset folder: parquet "
                    f"files for the configs {', '.join(CONFIG_NAMES)}, README.md with YAML `configs:` and real "
                    "statistics, medbanana-build.json and a SHA256SUMS manifest. Load it with "
                    "datasets.load_dataset(FOLDER, CONFIG).")
    build.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                       help="run directory, one {D}-edit / {D}-remove folder (then only it and its -failed "
                            "sibling are read), or a .jsonl of §5.2 records")
    build.add_argument("--out", required=True, type=Path, metavar="DIR",
                       help="output folder: new, empty, or an earlier build, which is replaced when done (only the "
                            "files builds write; anything else in it, or an input run inside it, is refused)")
    build.add_argument("--source-images", type=Path, metavar="DIR",
                       help="folder of source images ({D}/normal/<stem>.jpg, {D}/{Disease}/<stem>.jpg) to embed as "
                            "source_image; by default sources are not included (they are often not redistributable). "
                            "A folder holding none of the tasks' sources is an error; a partial match is counted")
    build.add_argument("--test-fraction", type=float, default=0.0, metavar="F",
                       help="put about this fraction of source images (and all their tasks) in a `test` split "
                            "(default 0: train only)")
    old_spelling(build, build.add_argument("--max-file-size", default="500MB", metavar="SIZE",
                                           help="largest parquet file, e.g. 500MB or 1GB (default 500MB)"),
                 "--max-shard-size")
    old_spelling(build, build.add_argument("--workers", type=int, default=1, metavar="N",
                                           help="processes writing the parquet files (default 1)"), "--num-proc")
    build.add_argument("--configs", default=",".join(CONFIG_NAMES), metavar="LIST",
                       help="comma-separated configs to build (default: all five)")
    build.add_argument("--unsafe", choices=POLICIES, default="error",
                       help="what to do with an input the build refuses: a path named by the run's data (or a "
                            "--source-images file) that leads outside its folder, e.g. through a symlink; a file "
                            "that is not a JPEG or PNG image (empty, truncated, text); a malformed JSON entry. "
                            "`error` (default): stop, naming the file, what named it and why, and write nothing. "
                            "`skip`: leave the task out and list the refusal in medbanana-build.json and the card")
    build.add_argument("--reviews", action="append", type=Path, default=[], metavar="REVIEW_DIR",
                       help="a `medbanana review` folder (repeatable): its answers become the human_review config, "
                            "one row per answer tied to the task by uid and round, raters pseudonymised")
    build.add_argument("--review-reasons", choices=("keep", "drop"), default="keep",
                       help="the raters' free-text reasons in human_review: keep (default) or drop (left empty)")
    build.add_argument("--accept", metavar="POLICY.json|RULE",
                       help="re-decide every task from the judge's recorded verdicts, without any new call, by a "
                            "POLICY.json made by `medbanana calibrate` or a rule ('score>=0.85', 'qualified', ...): "
                            "a task's first attempt that passes is its accepted edit, later attempts stay as judged "
                            "attempts, a task with none passing is failed; the card names the rule. With expert "
                            "labels (--reviews, or the policy's) the card states the experts' approval rate of the "
                            "accepted edits with a 95 %% interval")
    build.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    build.set_defaults(func=run_build)

    upload = subparsers.add_parser(
        "upload", help="upload a built dataset folder to the Hugging Face Hub",
        description="Check the folder's SHA256SUMS, create the dataset repository if needed and publish the folder "
                    "with huggingface_hub in ONE commit: the data files that differ from the repository's are "
                    "uploaded ahead (no revision names them yet), then a single commit adds them with README.md, "
                    "medbanana-build.json and SHA256SUMS and deletes the repository's files of this dataset the "
                    "manifest no longer lists (*.parquet under the config folders, figure3.png); other files in the "
                    "repository are kept. A reader sees the previous revision or the new one, never a mix. An "
                    "interrupted upload leaves the published dataset as it was; run it again to resume (content "
                    "already uploaded is not sent again). Nothing is sent when the repository already holds exactly "
                    "these files. The token comes from HF_TOKEN or `hf auth login`; HF_ENDPOINT selects the server.")
    upload.add_argument("folder", type=Path, metavar="DIR", help="a folder made by `medbanana build`")
    upload.add_argument("repo_id", metavar="REPO_ID", help="dataset repository, e.g. my-org/medbanana-50k")
    visibility = upload.add_mutually_exclusive_group()
    visibility.add_argument("--private", dest="private", action="store_const", const=True,
                            help="create the repository as private (default: the account's or organisation's "
                                 "default visibility); an existing public repository is refused, nothing is sent")
    visibility.add_argument("--public", dest="private", action="store_const", const=False,
                            help="create the repository as public (an existing repository keeps its visibility)")
    upload.add_argument("--revision", metavar="REV", help="branch to commit to (created if missing)")
    upload.set_defaults(func=run_upload)

    verify = subparsers.add_parser(
        "verify", help="check a built dataset folder against its SHA256SUMS (and its images' C2PA signatures)",
        description="Recompute the SHA-256 of every file listed in DIR/SHA256SUMS; report missing, changed and "
                    "unlisted files. With --c2pa, also read back the C2PA Content Credentials of every generated "
                    "image in DIR's parquet files (or, with --run, of every image in a run directory) and count "
                    "them valid / untrusted / invalid / missing, or mismatched when an intact manifest names another "
                    "task, round or instruction than the row (or the run's journal line) where the image sits, "
                    "naming the rows (pip install 'medbanana[c2pa]'). Exit code 0 when everything matches, 1 "
                    "otherwise.")
    verify.add_argument("folder", type=Path, metavar="DIR", nargs="?", help="a folder made by `medbanana build`")
    verify.add_argument("--c2pa", action="store_true",
                        help="check each generated image's C2PA manifest: 'invalid' when a hash or the signature "
                             "does not match (e.g. one pixel changed), 'missing' when it has none")
    verify.add_argument("--trust", type=Path, metavar="CA.pem",
                        help="trust anchors (PEM), e.g. `keys init`'s ca.pem: an image whose signer does not chain "
                             "to one counts as 'untrusted' (implies --c2pa; without it the signer is not checked)")
    verify.add_argument("--run", type=Path, metavar="RUN_DIR",
                        help="check the images of this run directory (implies --c2pa)")
    verify.add_argument("--workers", type=int, metavar="N",
                        help="processes reading manifests (default: one per CPU)")
    verify.set_defaults(func=run_verify)

    stats = subparsers.add_parser(
        "stats", help="the paper's Table 1, Table 2 and Figure 3 from run metadata",
        description="Regenerate from metadata alone (no images): Table 1 (per modality and direction: diseases, "
                    "successes, failures, success rate, average rounds of successful tasks), Table 2 (pass rate "
                    "of each rubric dimension over all judged attempts, weights, most frequent failure reasons) and "
                    "Figure 3 (PNG, four panels; needs pip install 'medbanana[eval]'). Writes OUT/table1.{md,csv}, "
                    "table2.{md,csv}, failure_reasons.{md,csv}, figure3.png, stats.json and report.md.")
    stats.add_argument("inputs", nargs="+", type=Path, metavar="RUN_DIR|DATASET",
                   help="run directories (any layout `medbanana build` reads) or built dataset folders")
    stats.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder (created)")
    stats.set_defaults(func=run_stats)



def run_build(args) -> int:
    from ..generation.dataset.output import BuildError
    from .build import build

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    try:
        info = build(args.run_dirs, args.out, configs=configs, test_fraction=args.test_fraction,
                     max_shard_size=args.max_file_size, num_proc=args.workers,
                     source_images=args.source_images, quiet=args.quiet, unsafe=args.unsafe,
                     reviews=args.reviews, review_reasons=args.review_reasons, accept=args.accept)
    except BuildError as exc:
        print(f"medbanana build: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.quiet:
        for config, splits in info["configs"].items():
            counts = ", ".join(f"{split} {v['rows']:,} rows in {len(v['files'])} file(s)" for split, v in splits.items())
            print(f"  {config:<14} {counts}")
    _report_sources(info["sources"], args.quiet, info["configs"])
    for name, shards in info.get("partial_runs", {}).items():
        print(f"warning: run {name} holds {len(shards['merged'])} of {shards['of']} shards (`merge --partial`): the "
              "tasks of the others are not in this build; its card says so", file=sys.stderr)
    for name, review in info.get("reviews", {}).items():
        if review["left_out"]:
            print(f"warning: review {name}: {review['left_out']} of {review['answers']} answers are about tasks "
                  "not in this build and were left out", file=sys.stderr)
    _report_acceptance(info.get("acceptance") or {}, args.quiet)
    if not args.quiet:
        print(f"wrote {args.out.resolve()}")
    missing = info["stats"]["missing_images"]
    if missing:
        examples = ", ".join(info["stats"]["missing_image_examples"][:3])
        print(f"warning: {missing} image file(s) named by the JSON were not found (e.g. {examples}); "
              "their rows have a null image", file=sys.stderr)
    refused = info["stats"]["refused"]
    if refused["count"]:
        print(f"warning: {refused['count']} input(s) refused and left out ({refused['tasks_left_out']} task(s)), "
              f"e.g. {refused['items'][0]}; all are listed under stats.refused in "
              f"{args.out / 'medbanana-build.json'}", file=sys.stderr)
    for name, coerced in info["stats"]["coerced"].items():  # one line per field
        read_as = ", ".join(f"{value} as {json.dumps(read)}" for value, read in coerced["examples"].items())
        what = "not numbers and were read as numbers or null" if name == "score" else \
            "not true/false and were read as booleans"
        print(f"warning: {coerced['count']:,} judge value(s) of '{name}' were {what} (e.g. {read_as}); counted "
              f"under stats.coerced in {args.out / 'medbanana-build.json'}", file=sys.stderr)
    return EXIT_OK


def _report_acceptance(acceptance: dict, quiet: bool) -> None:
    """The rule a build re-decided with, and the experts' approval of its accepted edits, as the card states them."""
    if acceptance.get("rule") and not quiet:
        print(f"  accepted by the rule {acceptance['rule']} (re-decided from the recorded verdicts)")
    approval = acceptance.get("expert_approval")
    if approval and approval["labels"]:
        estimate = approval["overall"]["estimate"]
        if estimate is None:
            print(f"warning: {approval['labels']} expert label(s) match this build: too few for an expert-approval "
                  "interval on the card", file=sys.stderr)
        elif not quiet:
            shown = min(1.0, max(0.0, estimate["estimate"]))
            print(f"  expert approval of the accepted edits: {shown:.1%} (95 % interval {estimate['low']:.1%} to "
                  f"{estimate['high']:.1%}) from {approval['labels']} expert label(s)")


def _report_sources(sources: dict | None, quiet: bool, configs) -> None:
    """--source-images' count, as the card and medbanana-build.json give it; a partial match is a warning. Without
    --source-images, one line says that source_image is null and how to attach the sources."""
    from .rows import IMAGE_CONFIGS

    if sources is None:
        if set(configs) & IMAGE_CONFIGS:
            print("note: source_image is null in every row (runs do not hold their sources); to attach them, build "
                  "again with --source-images DIR (the folder `generate --sources` read), or fill a loaded dataset "
                  "with medbanana.loaders.attach_sources(ds, DIR)", file=sys.stderr)
        return
    matched, total = sources["matched"], sources["total"]
    if matched < total:
        print(f"warning: source images attached to {matched:,} of {total:,} tasks; the other {total - matched:,} "
              f"have a null source_image (looked for e.g. {sources['missing_examples'][0]})", file=sys.stderr)
    elif not quiet:
        print(f"  source images attached to all {total:,} tasks")


def run_upload(args) -> int:
    from ..generation.secrets import scrub
    from .upload import UploadError, upload

    try:
        result = upload(args.folder, args.repo_id, private=args.private, revision=args.revision)
    except (UploadError, FileNotFoundError) as exc:  # refusals and network failures arrive as one UploadError line
        print(f"medbanana upload: error: {scrub(str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    if result.up_to_date:
        print(f"nothing to upload: {args.repo_id} is up to date (it holds the {result.files} files of {args.folder})")
        return EXIT_OK
    deleted = (f", deleted {len(result.deleted)} stale file(s) of an earlier build (e.g. {result.deleted[0]})"
               if result.deleted else "")
    print(f"uploaded {args.folder} to {args.repo_id}: sent {len(result.sent)} of {result.files} file(s){deleted}: "
          f"{result.url}")
    return EXIT_OK


def run_verify(args) -> int:
    from ..generation.dataset.manifest import verify_manifest

    if args.folder is None and args.run is None:
        print("medbanana verify: error: give a dataset folder DIR, or --run RUN_DIR", file=sys.stderr)
        return EXIT_USAGE
    if args.c2pa or args.trust or args.run:  # a missing extra is said before any file is hashed (cli: one line)
        from ..generation.rundir.signing import require_c2pa

        require_c2pa()
    ok = True
    if args.folder is not None:
        try:
            report = verify_manifest(args.folder)
        except (FileNotFoundError, ValueError) as exc:
            print(f"medbanana verify: error: {exc}", file=sys.stderr)
            if not (args.c2pa or args.trust):
                return EXIT_FAILURE
            ok = False  # the images' signatures can still be checked
        else:
            print(report.describe())
            ok = report.ok
    if args.c2pa or args.trust or args.run:
        ok = _verify_c2pa(args) and ok
    return EXIT_OK if ok else EXIT_FAILURE


def _verify_c2pa(args) -> bool:
    from .c2pa_check import dataset_images, run_images, verify_c2pa

    ok = True
    for label, target, images in (("dataset", args.folder, dataset_images), ("run", args.run, run_images)):
        if target is None or (label == "dataset" and not (args.c2pa or args.trust)):
            continue
        if not Path(target).is_dir():
            print(f"medbanana verify: error: {target} is not a folder", file=sys.stderr)
            return False
        try:
            report = verify_c2pa(images(target), trust=args.trust, workers=args.workers)
        except (ValueError, OSError) as exc:  # a journal or run configuration that leads outside, or unreadable
            print(f"medbanana verify: error: {exc}", file=sys.stderr)
            return False
        print(f"{label} {target}: " + report.describe())
        ok = report.ok and ok
    return ok


def run_stats(args) -> int:
    from ..generation.dataset.folder import FIGURE
    from ..generation.outcomes import TaskStatus
    from .summary import summarise, write_stats

    summary = summarise(args.inputs)
    written = write_stats(summary, args.out)
    stats = summary.stats
    counts = ", ".join(f"{stats.total_tasks(status):,} {status}" for status in TaskStatus)
    print(f"{stats.total_tasks():,} tasks ({counts}), {sum(stats.attempts.values()):,} attempts")
    if written["figure3"] == FIGURE:
        print(f"wrote {args.out.resolve()}/report.md and {FIGURE}")
    else:
        print(f"wrote {args.out.resolve()}/report.md; {FIGURE} {written['figure3']}")
    return EXIT_OK
