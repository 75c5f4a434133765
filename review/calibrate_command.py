"""`medbanana calibrate LABELS --run RUN|--dataset DIR --target-precision P --out POLICY.json`: the options, the
policy file written atomically, and what it found in a few lines (review/calibrate.py does the work)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..generation.files import atomic_write_text
from ..generation.vocabulary import old_spelling
from ..generation.failures import EXIT_OK, UsageError

DEFAULT_DELTA = 0.1
DEFAULT_BOOTSTRAP = 2000

DESCRIPTION = """\
Choose an acceptance rule from expert labels with a stated guarantee: among the rules on the judge's weighted
score (or on its booleans, --rule booleans), optionally one per modality, the one of largest yield whose expert
precision (the share of its accepted edits experts call qualified) is at least P with probability at least 1 - D
(Learn-then-Test, fixed-sequence testing from the strictest rule, exact binomial tails).

LABELS is `medbanana review export`'s CSV (id = <uid>#<round>, qualified, ...), best from a review created with
--calibration (a seeded random sample of judged attempts, stratified by modality and direction, inclusion
probabilities recorded); other labels are used, with a warning that the guarantee assumes a random sample. The
judge's verdicts come from the run (--run) or the dataset built from it (--dataset); nothing is judged again.

POLICY.json holds the rule, P, D, the bound reached, the yield, the labels used and kappa with a 95 % interval,
the edits the rule cannot decide with confidence, and the expert labels (for the card's expert-approval interval).
Apply it with `medbanana build RUN --accept POLICY.json --out DIR` (re-decides recorded verdicts, no new call) or
`medbanana generate ... --accept POLICY.json`. Too few labels for any rule: one line saying about how many more
would be needed, exit 2. See docs/calibration.md."""


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"want a number strictly between 0 and 1, not {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"want a whole number, 0 or more, not {text!r}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="expert labels -> an acceptance rule with a guarantee on expert precision (POLICY.json)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n"
               "  medbanana review demo/run --out cal --calibration --items 200   # raters label the sample\n"
               "  medbanana review export cal --out labels.csv\n"
               "  medbanana calibrate labels.csv --run demo/run --target-precision 0.9 --out policy.json\n"
               "  medbanana build demo/run --accept policy.json --out dataset")
    p.add_argument("labels", type=Path, metavar="LABELS", help="the labels CSV of `medbanana review export`")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=Path, metavar="RUN", help="the run directory the labelled edits come from")
    source.add_argument("--dataset", type=Path, metavar="DIR",
                        help="the dataset built from it (its conversations or judge config)")
    p.add_argument("--target-precision", type=_share, required=True, metavar="P",
                   help="the expert precision wanted of the accepted edits, e.g. 0.9")
    p.add_argument("--delta", type=_share, default=DEFAULT_DELTA, metavar="D",
                   help=f"the chance allowed that the precision is below P after all (default {DEFAULT_DELTA})")
    p.add_argument("--out", type=Path, required=True, metavar="POLICY.json", help="the policy file to write")
    p.add_argument("--rule", choices=("score", "booleans"), default="score",
                   help="the rules tried: thresholds on the weighted score (default), or the booleans' chain "
                        "(qualified, then all of structure, realism, fidelity, then fewer)")
    p.add_argument("--per-modality", action="store_true",
                   help="one rule per modality, each at delta / (number of modalities)")
    p.add_argument("--band", type=_count, default=1, metavar="K",
                   help="undecided edits: those the K rules either side of the chosen one decide otherwise "
                        "(default 1)")
    old_spelling(p, p.add_argument("--repeated-verdicts", type=Path, metavar="verdicts.jsonl",
                                   help="`judge-agreement --repeats K`'s verdicts.jsonl: edits whose repeats the "
                                        "rule decides differently are undecided too"), "--repeats")
    p.add_argument("--bootstrap", type=_count, default=DEFAULT_BOOTSTRAP, metavar="N",
                   help=f"bootstrap resamples for kappa's interval (default {DEFAULT_BOOTSTRAP})")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args) -> int:
    from .calibrate import calibrate, read_repeats
    from .judged import judged_tasks, read_labels

    source = args.run or args.dataset
    labels = read_labels(args.labels)
    if not labels:
        raise UsageError(f"{args.labels}: no labelled edit")
    tasks = judged_tasks(source)
    repeats = read_repeats(args.repeated_verdicts) if args.repeated_verdicts else None
    policy = calibrate(tasks, labels, target=args.target_precision, delta=args.delta, family=args.rule,
                       per_modality=args.per_modality, band=args.band, repeats=repeats, bootstrap=args.bootstrap,
                       seed=args.seed)
    policy["source"] = {"run" if args.run else "dataset": str(Path(source).resolve())}
    atomic_write_text(args.out, json.dumps(policy, indent=2) + "\n")
    print_summary(policy, source, args.out)
    return EXIT_OK


def print_summary(policy: dict, source: Path, out: Path) -> None:
    labels, kappa, found = policy["labels"], policy["kappa"], policy["yield"]
    if not labels["calibration_sample"]:
        print(f"warning: {labels['sample_note']}", file=sys.stderr)
    if labels["unmatched"]:
        print(f"warning: {labels['unmatched']} labelled id(s) are not judged attempts of {source}: left out",
              file=sys.stderr)
    print(f"rule: {policy['rule']}  ({policy['guarantee']})")
    for name, group in policy["groups"].items():
        print(f"  {name}: {group['rule']}: {group['approved']} of {group['labelled']} labelled accepted edits "
              f"approved; precision lower bound {group['lower_bound']:.3f} at delta {group['delta']:g}, "
              f"p = {group['p_value']:.3g}; accepts {group['accepted']} task(s)")
    for name in policy["modalities_without_rule"]:
        print(f"  {name}: no rule passes: this modality accepts nothing (label more of its edits)", file=sys.stderr)
    interval = kappa["ci95"]
    print(f"yield: {found['accepted']} of {found['tasks']} tasks accepted ({found['share']:.1%}); kappa with the "
          f"experts {_number(kappa['value'])}"
          + (f" (95 % interval {interval[0]:.2f} to {interval[1]:.2f})" if interval else "")
          + f" on {kappa['n']} labels")
    undecided = policy["undecided"]
    if undecided:
        print(f"{len(undecided)} edit(s) the rule cannot decide with confidence (listed in {out}); have them "
              f"reviewed: medbanana review {source} --out REVIEW_DIR --only {out}")
    print(f"wrote {out}; apply it with `medbanana build RUN --accept {out} --out DIR` or `generate ... --accept "
          f"{out}`")


def _number(value) -> str:
    return "undefined" if value is None else f"{value:.2f}"
