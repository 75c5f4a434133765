"""Subcommands `eval` and `judge-agreement` of the `medbanana` command (cli.py calls `register`)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from ..generation import backends
from ..generation.files import atomic_write_text
from ..generation.rundir.lock import hold_lock
from ..generation.vocabulary import workers_count
from .failures import eval_exit_code, first_time
from .sent import check_judge_destination
from ..generation.failures import EXIT_OK, EXIT_USAGE, UsageError

INPUT_HELP = ("an evaluation folder (samples.jsonl or samples.csv; see evaluation/inputs.py), a folder made by "
              "`medbanana build`, or a run directory")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="score an editing model's outputs: context preservation, SSIM, PSNR, LPIPS, EA and VQ",
        description="Score edits: context preservation (SSIM outside the ROI; --cp-mode medebench reproduces "
                    "MedEBench's published computation), MedGEN-Bench's SSIM (grayscale) / PSNR (RGB, identical = "
                    "100) / LPIPS (only when its weights are on this machine), and editing accuracy (EA), visual "
                    "quality (VQ) and the judge's context preservation through a judge backend, 0-10 reported /10 "
                    "with the prompt recorded. Writes OUT/samples.jsonl (one record per sample), OUT/report.md and "
                    "tables per modality, disease and direction (markdown and CSV). Rerunning into the same OUT "
                    "with the same settings scores only what is missing. Exit code 0 when samples were scored "
                    "(failures counted, top reasons on stderr), 3 when none could be (or, with a judge, none got "
                    "a verdict).")
    p.add_argument("input", type=Path, metavar="INPUT", help=INPUT_HELP)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder (created; reused to resume)")
    _add_input_options(p)
    p.add_argument("--edits", type=Path, metavar="DIR",
                   help="a model's outputs for a dataset's or run's tasks, named EDITS/<uid>.png|.jpg; the "
                        "dataset's or run's edit becomes the ground truth")
    p.add_argument("--all-attempts", action="store_true",
                   help="run directories: score every attempt that produced an image (default: accepted edits)")
    p.add_argument("--limit", type=int, metavar="N", help="only the first N samples (for a quick try)")
    p.add_argument("--cp-mode", choices=("correct", "medebench"), default="correct",
                   help="correct: mean SSIM map outside the ROI dilated by half the window (default); medebench: "
                        "ROI zeroed in both images, SSIM over the whole image, as MedEBench's code does")
    p.add_argument("--roi", choices=("auto", "edit", "region", "none"), default="auto",
                   help="the ROI outside which CP is measured: auto (default): an evaluation folder's mask, else for "
                        "datasets and runs the task's edit mask (the row's edit_mask, or computed from source and "
                        "edit), else the target's anatomical region; edit, region or none (full image) alone")
    p.add_argument("--no-lpips", dest="lpips", action="store_false", help="skip LPIPS even when it is available")
    p.add_argument("--workers", type=workers_count, default=1, metavar="N|auto",
                   help="processes scoring samples, a local judge's too (auto: one per CPU as memory allows; "
                        "default 1); the figures do not depend on it")
    p.add_argument("--attention", action="store_true",
                   help="edits made with `generate --diffusers-attention`: also report the IoU of the disease "
                        "words' thresholded cross-attention with each sample's ROI (as --roi: the edit_mask, else "
                        "the task's region; each figure says which) and the mislocalisation rate per disease "
                        "(attention.json). The attention is read from INPUT when it is a run directory, else from "
                        "--attention-run")
    p.add_argument("--attention-run", type=Path, action="append", metavar="RUN_DIR",
                   help="a run whose edits recorded attention, for a built dataset's samples (implies --attention; "
                        "repeat for a dataset built from several runs)")
    _add_judge_options(p, default="simulator", allow_none=True)
    _add_probe_options(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_eval)

    p = subparsers.add_parser(
        "judge-agreement", help="judge reliability: repeat consistency and agreement with human labels",
        description="Re-judge edits K times (--repeats) and report the identical-verdict rate and per-dimension "
                    "flips; and/or compare the judge's verdicts with human labels from a CSV (--human: id or "
                    "uid+round, qualified, and any of has_disease, structure_reasonable, looks_realistic, "
                    "fidelity_preserved): agreement, Cohen's kappa, confusion matrix, too strict / too lenient. "
                    "The judge's labels are the recorded verdicts; edits without one are judged once.")
    p.add_argument("input", type=Path, metavar="INPUT", help=INPUT_HELP)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder (created)")
    _add_input_options(p, default_config="judge")
    p.add_argument("--repeats", type=int, default=0, metavar="K", help="judge each edit K >= 2 times (default: no)")
    p.add_argument("--human", type=Path, metavar="CSV", help="human labels to compare the judge with")
    p.add_argument("--limit", type=int, default=500, metavar="N",
                   help="random sample of N edits for --repeats (default 500, as in the paper)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sample (default 0)")
    _add_judge_options(p, default="simulator", allow_none=False, temperature=0.7)
    p.set_defaults(func=run_judge_agreement)


def _add_input_options(p, default_config: str = "sft") -> None:
    g = p.add_argument_group("built datasets and run directories")
    g.add_argument("--config", choices=("sft", "failed", "judge"),
                   help=f"config of a built dataset to read (default {default_config})")
    g.add_argument("--split", metavar="SPLIT", help="split of a built dataset (default: all)")
    g.add_argument("--source-images", type=Path, metavar="DIR",
                   help="source images ({D}/normal, {D}/{Disease} layout) when the dataset or run lacks them; "
                        "required to score a run: the sources folder a run records is named, never followed")
    p.set_defaults(default_config=default_config)


def _add_probe_options(p) -> None:
    g = p.add_argument_group("realism and counterfactual probes (docs/probes.md)")
    g.add_argument("--separability", action="store_true",
                   help="can a linear probe on weight-free forensics features tell real sources from edits? "
                        "AUROC (0.5 = indistinguishable) with a 95%% interval and a permutation p-value, grouped "
                        "k-fold by source image, "
                        "raw and controlled (both sides re-encoded alike), per modality and direction; with "
                        "--all-attempts rejected edits get their own rows. Writes separability.{md,csv,json,png}. "
                        "Each image's features are appended to OUT/medbanana-cache/probe-features/ as they are "
                        "computed (keyed by the image's bytes and the feature settings): rerun the same command "
                        "after an interruption and only the missing ones are computed")
    g.add_argument("--probe-size", type=int, default=256, metavar="PX",  # probe_features.PROBE_SIZE
                   help="pixels a side of each view the separability features measure (default 256)")
    g.add_argument("--probe-detail", type=int, default=1024, metavar="PX",  # probe_features.PROBE_DETAIL
                   help="also measure a --probe-size crop of the image's centre brought to PX² (the fine detail a "
                        "blur or resampling editor leaves; sees resolution too); 0 = whole image only (default 1024)")
    g.add_argument("--probe-quality", type=int, default=90, metavar="Q",
                   help="JPEG quality of the controlled re-encoding (default 90)")
    g.add_argument("--probe-workers", type=int, metavar="N", help="feature worker processes (default: all cores)")
    g.add_argument("--probe-features", metavar="SPEC",
                   help="also probe on pretrained embeddings: timm:NAME (weights downloaded at run time), "
                        "timm:FOLDER (saved by timm) or open_clip:MODEL/PRETRAINED; rows marked with SPEC")
    g.add_argument("--classifier", metavar="SPEC",
                   help="counterfactual validity: torchxrayvision:WEIGHTS (chest X-ray, e.g. "
                        "torchxrayvision:densenet121-res224-all; pip install 'medbanana[probes-xray]') or a "
                        "transformers image-classification checkpoint folder / Hub id with id2label; reports the "
                        "change of the target finding's probability, the share crossing --threshold and the change "
                        "of the other findings per disease and direction. Writes counterfactual.{md,csv,json,png}")
    g.add_argument("--classifier-weights", type=Path, metavar="FILE",
                   help="torchxrayvision weights file to use instead of ~/.torchxrayvision/models_data/ "
                        "(docs/probes.md: offline machines)")
    g.add_argument("--threshold", type=float, default=0.5, metavar="P",
                   help="probability threshold for the crossing share (default 0.5)")


def _add_judge_options(p, *, default: str, allow_none: bool, temperature: float | None = None) -> None:
    g = p.add_argument_group("judge (gemini: key from GEMINI_API_KEY or GOOGLE_API_KEY)")
    names = backends.available("judge") + (["none"] if allow_none else [])
    g.add_argument("--judge", default=default, choices=names,
                   help=f"judge backend (default {default}{'; none: pixel metrics only' if allow_none else ''})")
    g.add_argument("--judge-model", metavar="MODEL", help="gemini judge model (default gemini-2.5-pro)")
    g.add_argument("--temperature", type=float, default=temperature, metavar="T",
                   help=f"gemini sampling temperature (default {temperature if temperature is not None else 'the model default'})")
    g.add_argument("--base-url", metavar="URL", help="gemini API base URL (e.g. a local test server)")
    g.add_argument("--concurrency", type=int, default=2, metavar="N", help="samples in flight (default 2)")


def _judge(args, cache_dir: Path | None):
    from .judging import make_judge

    if args.judge == "none":
        return None
    if args.judge != "gemini":
        return make_judge(args.judge)
    return make_judge("gemini", model=args.judge_model, temperature=args.temperature, base_url=args.base_url,
                      cache_dir=cache_dir)


def _samples(args, attempts: str):
    from ..generation.dataset.inputs import input_kind
    from .inputs import open_samples

    config = args.config or (args.default_config if input_kind(args.input) == "dataset" else None)
    return lambda: open_samples(args.input, config=config, split=args.split, edits=getattr(args, "edits", None),
                                source_images=args.source_images, attempts=attempts, follow_recorded_sources=False)


def run_eval(args) -> int:
    from ..generation.dataset.inputs import input_kind
    from .inputs import sources_notice

    if args.source_images is None and input_kind(args.input) == "run":  # a run holds no sources to score with
        raise UsageError(sources_notice(args.input))
    check_judge_destination(args)  # before anything is read or sent (generation/destinations.py's gate)
    attempts = "all" if args.all_attempts else "accepted"
    make_samples = _samples(args, attempts)
    samples = make_samples()  # input errors surface here, before anything is written
    if args.attention or args.attention_run:
        _attention_runs(args)
    try:
        probes = _probe_prerequisites(args)
    except ImportError as exc:
        print(f"medbanana eval: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    with hold_lock(args.out, "evaluation folder"):  # one writer: two evals would both append to samples.jsonl
        code = _evaluate_into_out(args, samples, attempts)
        if args.separability or args.classifier:
            _run_probes(args, make_samples, *probes)
        return code


def _probe_prerequisites(args) -> tuple:
    """(classifier, embedder): dependencies checked and models loaded before any sample is scored."""
    classifier = embedder = None
    if args.probe_features and not args.separability:
        raise UsageError("--probe-features applies to --separability")
    if args.classifier_weights and not args.classifier:
        raise UsageError("--classifier-weights applies to --classifier torchxrayvision:WEIGHTS")
    if args.separability:
        if args.probe_size < 32 or not 1 <= args.probe_quality <= 100:
            raise UsageError("--probe-size is at least 32 and --probe-quality between 1 and 100")
        if args.probe_detail and args.probe_detail < args.probe_size:
            raise UsageError(f"--probe-detail is 0 (none) or at least --probe-size ({args.probe_size})")
        if args.probe_features:
            from .probe_embeddings import load_embedder

            embedder = load_embedder(args.probe_features)
    if args.classifier:
        if not 0 < args.threshold < 1:
            raise UsageError(f"--threshold is a probability between 0 and 1, not {args.threshold}")
        from .classifiers import load_classifier

        classifier = load_classifier(args.classifier, args.classifier_weights)
    return classifier, embedder


def _run_probes(args, make_samples, classifier, embedder) -> None:
    from tqdm import tqdm

    from .probe_report import write_probe_outputs

    def limited():
        samples = make_samples()
        return itertools.islice(samples, args.limit) if args.limit is not None else samples

    separability = counterfactual = None
    if args.separability:
        from .probe_cache import CACHE_NAME, FeatureCache
        from .probe_features import FeatureSettings
        from .separability import run_separability

        cache = FeatureCache(args.out / "medbanana-cache" / CACHE_NAME)
        try:
            with tqdm(disable=args.quiet, unit="image", desc="separability features") as bar:
                def progress():
                    bar.update()
                    if cache.reused:
                        bar.set_postfix_str(f"{cache.reused:,} reused from the cache", refresh=False)

                separability = run_separability(limited(), workers=args.probe_workers, embedder=embedder,
                                                settings=FeatureSettings(args.probe_size, args.probe_quality,
                                                                         args.probe_detail),
                                                progress=progress, cache=cache)
        finally:
            cache.close()
        print(f"separability features: {cache.stored:,} computed, {cache.reused:,} reused from {cache.path}")
        for row in separability["rows"]:
            print(f"separability [{row['features']}] {row['modality']} {row['direction']} {row['comparison']}: "
                  f"AUROC raw {_fmt(row['auroc_raw'])} (p {_fmt(row['p_raw'])}), controlled "
                  f"{_fmt(row['auroc_controlled'])} (p {_fmt(row['p_controlled'])}) "
                  f"({row['real']:,} vs {row['compared']:,} images, {row['sources']:,} sources)")
    if classifier is not None:
        from .counterfactual import run_counterfactual

        with tqdm(disable=args.quiet, unit="edit", desc="counterfactual") as bar:
            counterfactual = run_counterfactual(limited(), classifier, threshold=args.threshold, progress=bar.update)
        for row in counterfactual["rows"]:
            print(f"counterfactual {row['modality']} {row['disease']} {row['direction']}: {row['edits']:,} edits, "
                  f"mean delta {row['mean_delta']:+.3f}, crossed {row['crossed']:.1%}, other change "
                  f"{_fmt(row['other_change'])}")
    for note in write_probe_outputs(args.out, separability, counterfactual):
        print(note, file=sys.stderr)


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.3f}"


def _evaluate_into_out(args, samples, attempts: str) -> int:
    from .evaluate import EvalOptions, evaluate
    from .judging import judge_description

    judge = _judge(args, cache_dir=args.out / "medbanana-cache" / "gemini")
    settings = {"input": str(args.input.resolve()), "config": args.config, "split": args.split,
                "edits": str(args.edits.resolve()) if args.edits else None, "attempts": attempts,
                "cp_mode": args.cp_mode, "roi": args.roi,
                "judge": judge_description(judge) if judge else None}
    options = EvalOptions(cp_mode=args.cp_mode, roi=args.roi, lpips=args.lpips,
                          concurrency=args.concurrency, workers=args.workers, quiet=args.quiet,
                          total=_total(args, attempts))
    if args.limit is not None:
        samples = itertools.islice(samples, args.limit)
    summary = evaluate(samples, args.out, settings=settings, options=options, judge=judge)
    print(summary_line(summary))
    for note in summary["notes"]:
        if note.startswith("LPIPS") and first_time(note):  # once per machine; report.md keeps it every time
            print(note, file=sys.stderr)
    if args.attention or args.attention_run:
        _report_attention(args, _samples(args, attempts))
    print(f"wrote {args.out.resolve()}/report.md")
    return eval_exit_code(summary)


def _total(args, attempts: str) -> int | None:
    """The progress bar's total: the input's samples where they can be counted cheaply, at most --limit."""
    from .inputs import count_samples

    if args.quiet:
        return None
    total = count_samples(args.input, config=args.config or args.default_config, split=args.split,
                          attempts=attempts)  # the config applies to a built dataset only
    return total if total is None or args.limit is None else min(total, args.limit)


def summary_line(summary: dict) -> str:
    """The printed result: counts, then the scores that exist, the CP mean saying what it leaves out."""
    shown, excluded = [], (summary.get("cp_excluded") or {}).get("samples", 0)
    for key, value in summary["overall"].items():
        if key == "CP" and excluded:  # also when every sample is excluded and there is no mean
            of = summary["cp_excluded"]["of"]
            shown.append(f"CP {'–' if value is None else format(value, '.3f')} (over {of - excluded:,} of {of:,}: "
                         f"{excluded:,} excluded, CP undefined for a full ROI)")
        elif key in ("CP", "SSIM", "PSNR", "LPIPS", "EA", "VQ") and value is not None:
            shown.append(f"{key} {value:.3f}")
    counts = (f"{summary['ok']:,} samples scored, {summary['errors']:,} errors, "
              f"{summary['judge_errors']:,} judge errors")
    return f"{counts}; {', '.join(shown)}" if shown else counts


def _attention_runs(args) -> list[Path]:
    """The runs --attention reads: --attention-run, else INPUT when it is a run directory (ValueError otherwise)."""
    from ..generation.dataset.inputs import input_kind

    if args.attention_run:
        for run in args.attention_run:
            if not Path(run).is_dir():
                raise UsageError(f"--attention-run {run} is not a folder: name the run directory whose edits "
                                 "recorded attention (generate --diffusers-attention)")
        return args.attention_run
    if input_kind(args.input) != "run":
        raise UsageError(f"--attention: {args.input} is not a run directory; name the run its edits came from "
                         "with --attention-run RUN_DIR (the attention masks are recorded there)")
    return [args.input]


def _report_attention(args, make_samples) -> None:
    from .attention import attention_report, attention_warnings

    samples = make_samples()
    if args.limit is not None:
        samples = itertools.islice(samples, args.limit)
    report = attention_report(samples, _attention_runs(args), args.roi)
    if not report["samples"]:
        print(f"--attention: no edit of {args.input} recorded attention (generate --diffusers-attention)",
              file=sys.stderr)
    for line in attention_warnings(report):
        print(f"warning: --attention: {line}", file=sys.stderr)
    atomic_write_text(Path(args.out) / "attention.json", json.dumps(report, indent=2))
    for disease, row in report["by_disease"].items():
        rois = ", ".join(f"{kind} {n:,}" for kind, n in row["roi"].items())
        print(f"attention {disease}: n {row['n']}, mean IoU {row['mean_iou']:.3f}, "
              f"mislocalised {row['mislocalisation_rate']:.1%} (roi: {rois})")


def run_judge_agreement(args) -> int:
    from .agreement import run_agreement
    from .judging import judge_description

    if args.judge != "gemini":
        args.temperature = None  # the temperature applies to the gemini judge only
    check_judge_destination(args)
    judge = _judge(args, cache_dir=None)  # no request cache: repeats must be fresh calls
    settings = {"input": str(args.input.resolve()), "judge": judge_description(judge), "repeats": args.repeats,
                "human": str(args.human) if args.human else None, "limit": args.limit, "seed": args.seed}
    report = run_agreement(_samples(args, "all"), args.out, judge=judge, repeats=args.repeats, human_csv=args.human,
                           limit=args.limit, seed=args.seed, concurrency=args.concurrency, settings=settings)
    consistency = report.get("repeat_consistency")
    if consistency and consistency["identical_rate"] is not None:
        print(f"repeat consistency: {consistency['identical_rate']:.1%} identical over {consistency['edits']} edits "
              f"x {consistency['repeats']}")
    qualified = report.get("human_agreement", {}).get("dimensions", {}).get("qualified")
    if qualified:
        kappa = "–" if qualified["kappa"] is None else f"{qualified['kappa']:.3f}"
        print(f"human agreement on qualified: {qualified['agreement']:.1%} over {qualified['edits']} edits, kappa "
              f"{kappa}, too strict {qualified['too_strict']:.1%}, too lenient {qualified['too_lenient']:.1%}")
    print(f"wrote {args.out.resolve()}/report.md")
    return EXIT_OK
