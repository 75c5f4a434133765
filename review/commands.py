"""`medbanana review`: create a blind review and serve its page, serve one again, export its labels, report on it.

One parser takes the three forms (argparse cannot put a positional SOURCE beside sub-subcommands): the first word
picks the form — `export` or `report`, else a SOURCE to sample (with --out) or a REVIEW_DIR to serve — and options
that belong to another form are refused with one clear line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..generation.dataset.review_folder import DB_NAME, MODES  # the store itself is imported when a form needs it
from ..generation.extras import check_installed
from ..generation.failures import EXIT_OK, NotFound, UsageError
from ..generation.files import read_user_text

DEFAULT_ITEMS = 100
DEFAULT_RATERS = 2
DEFAULT_PORT = 7860
DEFAULT_BOOTSTRAP = 2000
VERBS = ("export", "report")

USAGE = """\
medbanana review SOURCE --out REVIEW_DIR [--mode rubric|realism] [--items N] [--raters-per-item K]
                        [--calibration | --only POLICY.json|IDS] [--seed S] [--source-images DIR]
                        [--host HOST] [--port P] [--no-serve]
       medbanana review REVIEW_DIR [--host HOST] [--port P]
       medbanana review export REVIEW_DIR --out labels.csv [--rater NAME]
       medbanana review report REVIEW_DIR --out DIR [--bootstrap N] [--seed S]"""

DESCRIPTION = """\
Blind expert review of edits and of the judge, on a local web page (pip install 'medbanana[review]').

  medbanana review SOURCE --out REVIEW_DIR ...
      Sample --items edits of SOURCE (a dataset folder made by `medbanana build`, or a run directory),
      stratified by modality, direction, disease and the judge's outcome (seeded, reproducible), into a new
      review folder, and serve its page. rubric mode: source and edit side by side (and a slider), the
      instruction; the rater answers the four rubric dimensions, `qualified` and an optional reason. realism
      mode: single images, real and edited shuffled: "real or edited?" and a confidence 1-5; no rater sees one
      source both real and edited. Raters never see the judge's verdict, the model, the round or the outcome.
      --calibration draws a calibration sample instead, for `medbanana calibrate`: a seeded random sample of
      judged attempts (accepted and rejected), stratified by modality and direction, each item's inclusion
      probability recorded. --only POLICY.json reviews exactly the edits `calibrate` could not decide (or the
      ids of a CSV's `id` column, or of a text file, one per line).
  medbanana review REVIEW_DIR
      Serve an existing review again (a folder holding review.sqlite): raters continue where they stopped.
  medbanana review export REVIEW_DIR --out labels.csv [--rater NAME]
      Write a rubric review's answers as the CSV `medbanana judge-agreement RUN --human labels.csv` reads.
  medbanana review report REVIEW_DIR --out DIR
      Inter-rater agreement per dimension (Cohen's / Fleiss' kappa, Krippendorff's alpha, bootstrap 95 %
      intervals), judge-vs-human agreement and confusion matrices; realism: detection accuracy and AUROC.

Answers are stored as they are given (SQLite, WAL, append-only) in REVIEW_DIR/review.sqlite: several raters at
once, a reload resumes, a stopped or killed server loses nothing answered. Each rater enters a name (letters,
digits, spaces and . - _ ' only); on a Hugging Face Space they sign in with Hugging Face instead.
The page is served on --host (default 127.0.0.1: this machine only) and never contacts the network."""

# (flag, argparse keywords, the forms it belongs to: "create", "serve", "export", "report"); one table for the
# combined parser and for `review export --help` / `review report --help`
OPTIONS = (
    ("--out", dict(type=Path, metavar="PATH", help="creating: the new review folder; export: the labels CSV; "
                                                   "report: the report folder"), {"create", "export", "report"}),
    ("--mode", dict(choices=MODES, help="creating: rubric (default) or realism"), {"create"}),
    ("--items", dict(type=int, metavar="N", help=f"creating: edits to sample (default {DEFAULT_ITEMS})"), {"create"}),
    ("--raters-per-item", dict(type=int, metavar="K", help=f"creating: answers wanted per item (default "
                                                           f"{DEFAULT_RATERS})"), {"create"}),
    ("--seed", dict(type=int, metavar="S", help="creating: the sample's seed; report: the bootstrap's seed "
                                                "(default 0)"), {"create", "report"}),
    ("--source-images", dict(type=Path, metavar="DIR",
                             help="creating: the folder of the source images, for a dataset built without them or a "
                                  "run whose medbanana-run.json names a sources folder outside the run (confirm it "
                                  "here)"), {"create"}),
    ("--host", dict(metavar="HOST", help="serving: the address to listen on (default 127.0.0.1; 0.0.0.0 opens it to "
                                         "the network)"), {"create", "serve"}),
    ("--port", dict(type=int, metavar="P", help=f"serving: the port (default {DEFAULT_PORT})"), {"create", "serve"}),
    ("--no-serve", dict(action="store_true", help="creating: create the review folder and stop"), {"create"}),
    ("--calibration", dict(action="store_true",
                           help="creating: a calibration sample for `medbanana calibrate` (seeded random, judged "
                                "attempts, stratified by modality and direction, inclusion probabilities recorded)"),
     {"create"}),
    ("--only", dict(type=Path, metavar="FILE",
                    help="creating: exactly these edits: a POLICY.json's undecided edits, a CSV's id column or one "
                         "id per line"), {"create"}),
    ("--rater", dict(metavar="NAME", help="export: one rater's own answers instead of the majority"), {"export"}),
    ("--bootstrap", dict(type=int, metavar="N", help=f"report: bootstrap resamples for the intervals (default "
                                                     f"{DEFAULT_BOOTSTRAP})"), {"report"}),
)
FORMS_OF = {flag[2:].replace("-", "_"): forms for flag, _, forms in OPTIONS}
FORM_NAMES = {"create": "creating a review (SOURCE --out REVIEW_DIR)", "serve": "serving an existing REVIEW_DIR",
              "export": "`medbanana review export`", "report": "`medbanana review report`"}
VERB_HELP = {
    "export": ("medbanana review export REVIEW_DIR --out labels.csv [--rater NAME]",
               "Write a rubric review's answers as the CSV `medbanana judge-agreement RUN --human labels.csv` reads: "
               "one row per edit, the majority of its raters' labels (or one rater's own with --rater)."),
    "report": ("medbanana review report REVIEW_DIR --out DIR [--bootstrap N] [--seed S]",
               "Inter-rater agreement per dimension (Cohen's / Fleiss' kappa, Krippendorff's alpha, bootstrap 95 % "
               "intervals), judge-vs-human agreement and confusion matrices; realism: detection accuracy and AUROC."),
}


class _FormHelp(argparse.Action):
    """-h/--help: `review export --help` and `review report --help` show that form's own options, not the whole
    command's (the form is the first word, read before the flag)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show this help and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        words = getattr(namespace, "words", None) or []
        (verb_parser(words[0]) if words and words[0] in VERBS else parser).print_help()
        parser.exit()


def verb_parser(verb: str) -> argparse.ArgumentParser:
    """The parser `medbanana review VERB --help` prints: REVIEW_DIR and the options of that form."""
    usage, description = VERB_HELP[verb]
    p = argparse.ArgumentParser(prog=f"medbanana review {verb}", usage=usage, description=description)
    p.add_argument("review_dir", type=Path, metavar="REVIEW_DIR", help="a review folder (holding review.sqlite)")
    for flag, keywords, forms in OPTIONS:
        if verb in forms:  # of a help naming several forms ("creating: ...; report: ..."), this form's part
            parts = [part.partition(": ")[2] for part in keywords["help"].split("; ") if part.startswith(verb + ":")]
            p.add_argument(flag, **{**keywords, "help": "; ".join(parts) or keywords["help"]},
                           required=flag == "--out")
    return p


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "review", help="blind expert review on a web page: rubric or realism, export labels, inter-rater report",
        usage=USAGE, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False,
        epilog="example:\n"
               "  medbanana review demo/run --out review-1 --items 6 --raters-per-item 2   # open the URL it prints\n"
               "  medbanana review export review-1 --out labels.csv\n"
               "  medbanana judge-agreement demo/run --out agreement --human labels.csv\n"
               "each form's own options: medbanana review export --help, medbanana review report --help")
    p.add_argument("-h", "--help", action=_FormHelp)
    p.add_argument("words", nargs="+", metavar="SOURCE|REVIEW_DIR",
                   help="a dataset or run to sample (with --out), a review folder to serve, or export / report "
                        "followed by a review folder")
    for flag, keywords, _forms in OPTIONS:
        p.add_argument(flag, **keywords)
    p.set_defaults(func=run_review)
    from .calibrate_command import register as register_calibrate

    register_calibrate(subparsers)


def run_review(args) -> int:
    words = args.words
    if words[0] in VERBS:
        if len(words) != 2:
            raise UsageError(f"usage: medbanana review {words[0]} REVIEW_DIR --out PATH (one review folder)")
        _refuse_options(args, words[0])
        if args.out is None:
            raise UsageError(f"medbanana review {words[0]} needs --out")
        return run_export(args, Path(words[1])) if words[0] == "export" else run_report(args, Path(words[1]))
    if len(words) != 1:
        raise UsageError(f"expected one SOURCE or REVIEW_DIR, got {' '.join(words)} (export and report come first: "
                         "`medbanana review export REVIEW_DIR --out labels.csv`)")
    target = Path(words[0])
    is_review = (target / DB_NAME).is_file()
    if args.out is None:
        if not is_review:
            what = "is not a review folder (no review.sqlite)" if target.exists() else "does not exist"
            raise NotFound(f"{target} {what}; to create a review from a dataset or run, give --out "
                                    "REVIEW_DIR")
        _refuse_options(args, "serve")
        from .store import ReviewStore

        return _serve(ReviewStore.open(target), args)
    if is_review:
        raise UsageError(f"{target} is a review folder, not a dataset or run: serve it with `medbanana review "
                         f"{target}` (without --out)")
    _refuse_options(args, "create")
    return run_create(args, target)


def _refuse_options(args, form: str) -> None:
    given = [name for name, forms in FORMS_OF.items() if form not in forms and getattr(args, name) not in (None, False)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        hint = " (options of creating a review are fixed when it is created)" if form == "serve" else ""
        raise UsageError(f"{flags} {'does' if len(given) == 1 else 'do'} not apply to {FORM_NAMES[form]}{hint}")


def run_create(args, source: Path) -> int:
    from .items import create_review

    if not args.no_serve:  # a missing gradio is said before the folder is made, not after a minute of preparing;
        # not imported yet: gradio reads its temp folder on import, and `serve` sets it to the review's own cache
        check_installed("gradio", needed_for="medbanana review", extra="review")
    only = None
    if args.only is not None:
        if args.calibration or args.items is not None:
            raise UsageError("--only reviews exactly the edits it lists: leave out --calibration and --items")
        only = listed_ids(args.only)
    store = create_review(source, args.out, mode=args.mode or "rubric",
                          items=len(only) if only else DEFAULT_ITEMS if args.items is None else args.items,
                          raters_per_item=DEFAULT_RATERS if args.raters_per_item is None else args.raters_per_item,
                          seed=0 if args.seed is None else args.seed, source_images=args.source_images,
                          calibration=args.calibration, only=only)
    settings = store.settings
    items = store.items()
    few = settings.edits < settings.requested_items
    short = f" (fewer edits than --items {settings.requested_items})" if few else ""
    print(f"created review {args.out}: {len(items)} {settings.mode} items from {settings.edits} edits{short}, "
          f"{settings.raters_per_item} rater(s) per item, seed {settings.seed}; sample: {settings.design}")
    if settings.round_auroc is not None:
        print(f"blinding: round 1 vs later rounds from the instructions shown, AUROC {settings.round_auroc:.2f} "
              "(0.5: indistinguishable)")
    if args.no_serve:
        print(f"serve it with: medbanana review {args.out}")
        return EXIT_OK
    try:
        return _serve(store, args)
    except ValueError as exc:  # e.g. the port is taken: the review exists now, so creating it again would fail
        raise UsageError(f"{exc} (the review is created: serve it with `medbanana review {args.out} --port P`)") \
            from exc


def listed_ids(path: Path) -> set[str]:
    """The edit ids `--only` names: a POLICY.json's undecided edits, a CSV's `id` column, or one id per line."""
    import csv

    if not Path(path).is_file():
        raise NotFound(f"--only: not found: {path}")
    text = read_user_text(path, "--only ")
    if Path(path).suffix.lower() == ".json":
        from ..generation.acceptance import read_policy

        ids = {str(entry["id"]) for entry in read_policy(path).get("undecided") or [] if isinstance(entry, dict)}
    elif Path(path).suffix.lower() == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
        if rows and "id" not in rows[0]:
            raise UsageError(f"--only {path}: a CSV of edits needs an id column")
        ids = {row["id"].strip() for row in rows if (row.get("id") or "").strip()}
    else:
        ids = {line.strip() for line in text.splitlines() if line.strip()}
    if not ids:
        raise UsageError(f"--only {path}: lists no edit")
    return ids


def _serve(store, args) -> int:
    from .app import serve

    return serve(store, host=args.host or "127.0.0.1", port=DEFAULT_PORT if args.port is None else args.port)


def run_export(args, folder: Path) -> int:
    from .export import export_labels

    summary = export_labels(folder, args.out, rater=args.rater)
    who = f"rater {summary['rater']}" if summary.get("rater") else f"{summary['raters']} rater(s), majority labels"
    print(f"wrote {summary['rows']} labelled edits to {args.out} ({summary['answers']} answers, {who}; "
          f"{summary['items_answered']} of {summary['items']} items answered)")
    if summary.get("left_out_qualified_tie"):
        print(f"left out {summary['left_out_qualified_tie']} edit(s) whose raters tie on qualified")
    print(f"compare with the judge: medbanana judge-agreement SOURCE --out DIR --human {args.out}")
    return EXIT_OK


def run_report(args, folder: Path) -> int:
    from .report import write_report

    report = write_report(folder, args.out, bootstrap=DEFAULT_BOOTSTRAP if args.bootstrap is None else args.bootstrap,
                          seed=0 if args.seed is None else args.seed)
    print(f"wrote {report}")
    return EXIT_OK
