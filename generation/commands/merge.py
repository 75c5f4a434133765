"""`medbanana merge`: shard run directories -> one (rundir/merge.py does the work)."""

from __future__ import annotations

from pathlib import Path
from ..failures import EXIT_OK


def register(sub) -> None:
    p = sub.add_parser("merge", help="combine shard run directories into one",
                       description="Merge the finished tasks of several run directories made with the same options "
                                   "(e.g. `generate --shard i/N` on N machines) into --out. A task finished in two "
                                   "inputs, or inputs made with other options, is an error. Rerunning an interrupted merge "
                                   "goes on after the tasks it wrote.")
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument("--out", type=Path, required=True, help="merged run directory (new, or one made with the same options)")
    p.add_argument("--partial", action="store_true",
                   help="merge shards of a --shard i/N split although some are missing (by default an incomplete "
                        "set is refused, naming the missing shards); the merged run records it, and the card of a "
                        "dataset built from it says so. Merging the missing ones into --out later completes it")
    p.set_defaults(func=cmd_merge)


def cmd_merge(args) -> int:
    from ..rundir.merge import merge_runs

    counts = merge_runs(args.runs, args.out, partial=args.partial)
    before = f" ({counts['merged_before']} merged before)" if counts["merged_before"] else ""
    print(f"merged {counts['tasks']} finished tasks{before} from {counts['inputs']} run directories into {args.out}")
    if shards := counts.get("shards"):
        if len(shards["merged"]) < shards["of"]:
            print(f"partial: {args.out} holds {len(shards['merged'])} of {shards['of']} shards (--partial); merge the "
                  "others into it later, a dataset built from it says so meanwhile")
    return EXIT_OK
