"""Synthesise run directories in the original Med-Banana layout, for tests and benchmarks of the builder.

`flavor="original"` writes exactly what the original scripts wrote (absolute `final_image_path`s of another
machine, api_failed tasks present only in progress.json / api_failures.json); `flavor="ours"` adds the fields our
generator records (uid, modality, task, source_path, success_round, verdict scores, an edit refusal, ...).
Outcomes follow the paper's shape (about 58 % of accepted tasks at round 1, 25 % at round 2, the rest later).
Images are small smooth-plus-noise JPEGs; `distinct_images` reuses a pool of encoded images for large benchmarks.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np

from ..generation.outcomes import TaskStatus
from ..generation.records import DEFAULT_MAX_ROUNDS
from ..generation.rundir import layout
from ..generation.taxonomy import load_taxonomy

DEFAULT_DATASETS = ("MIMIC_synthetic_cxr", "Brain_Tumor_MRI_synthetic", "ODIR_synthetic")
_WORDS = ("the opacity lower zone effusion meniscus costophrenic angle subtle density margins blend texture preserve "
          "anatomy noise grain realistic pleural boundary soft edges structure plausible fidelity region lesion "
          "cortex vessel contrast intensity").split()


class _ImageMaker:
    def __init__(self, rng: np.random.Generator, size: int, distinct: int | None):
        self.rng, self.size, self.distinct, self.pool = rng, size, distinct, []

    def next(self) -> bytes:
        if self.distinct is not None and len(self.pool) >= self.distinct:
            return self.pool[int(self.rng.integers(len(self.pool)))]
        from PIL import Image

        y, x = np.mgrid[0:self.size, 0:self.size]
        phase = self.rng.uniform(0, 6.28, 2)
        base = 128 + 60 * np.sin(x / (self.size / 12) + phase[0]) + 40 * np.cos(y / (self.size / 9) + phase[1])
        pixels = np.clip(base + self.rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).convert("RGB").save(buf, format="JPEG", quality=90)
        data = buf.getvalue()
        if self.distinct is not None:
            self.pool.append(data)
        return data


def _text(rng: np.random.Generator, words: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(len(_WORDS), size=max(1, words)))


def _outcome(rng: np.random.Generator, max_rounds: int) -> tuple[TaskStatus, int]:
    """(status, number of rounds)."""
    if rng.random() < 0.43:
        return TaskStatus.FAILED, max_rounds
    r = rng.random()
    k = 1 if r < 0.58 else 2 if r < 0.83 else int(rng.integers(3, max_rounds + 1))
    return TaskStatus.SUCCESS, min(k, max_rounds)


def make_synthetic_run(run_dir: Path, *, flavor: str = "original", tasks_per_folder: int = 8,
                       datasets: tuple[str, ...] = DEFAULT_DATASETS, api_failed_per_folder: int = 1,
                       max_rounds: int = DEFAULT_MAX_ROUNDS, image_size: int = 32, distinct_images: int | None = None,
                       text_words: int = 12, sources_dir: Path | None = None, write_images: bool = True,
                       seed: int = 0) -> dict:
    """Write a run directory; returns {"attempts", "image_bytes", "tasks"} of what was written.

    `write_images=False` writes the JSON only (metadata benchmarks)."""
    if flavor not in ("original", "ours"):
        raise ValueError("flavor is 'original' or 'ours'")
    run_dir = Path(run_dir)
    rng = np.random.default_rng(seed)
    images = _ImageMaker(rng, image_size, distinct_images)
    taxonomy = load_taxonomy()
    written = {"attempts": 0, "image_bytes": 0, "tasks": 0}
    for dataset in datasets:
        modality = taxonomy.infer_modality(dataset)
        diseases = [label.folder for label in taxonomy.modality(modality).targets][:3]
        for direction in ("add", "remove"):
            out_dir = layout.output_dir(run_dir, dataset, direction)
            out_dir.mkdir(parents=True, exist_ok=True)
            layout.failed_dir(run_dir, dataset, direction).mkdir(parents=True, exist_ok=True)
            conversations, progress, final_prompts, failed_summary, api_failures = {}, {}, {}, [], []
            for i in range(tasks_per_folder + api_failed_per_folder):
                disease = diseases[i % len(diseases)]
                # add tasks share each normal source between two diseases; remove sources are one per task
                stem = f"n{i // 2:05d}" if direction == "add" else f"d{i:05d}"
                key = f"{stem}-{disease}"
                source_class = "normal" if direction == "add" else disease
                source_rel = f"{dataset}/{source_class}/{stem}.jpg"
                source_sha = None
                if sources_dir is not None:
                    path = Path(sources_dir) / source_rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    if not path.exists():
                        path.write_bytes(images.next())
                    source_sha = hashlib.sha256(path.read_bytes()).hexdigest()
                if i >= tasks_per_folder:  # api_failed: only in progress.json and api_failures.json
                    progress[key] = TaskStatus.API_FAILED
                    api_failures.append({"task": key, "step": "edit_image", "round": 1, "disease": disease,
                                         "error": "503 UNAVAILABLE: The model is overloaded.", "image": f"{stem}.jpeg"})
                    continue
                status, k = _outcome(rng, max_rounds)
                rounds = []
                for number in range(1, k + 1):
                    accepted = status == TaskStatus.SUCCESS and number == k
                    refused = flavor == "ours" and not accepted and i % 5 == 3 and number == 1
                    rel = layout.attempt_image_relpath(dataset, direction, stem, disease, number, accepted)
                    if not refused and write_images:
                        data = images.next()
                        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                        (run_dir / rel).write_bytes(data)
                        written["image_bytes"] += len(data)
                    written["attempts"] += 1
                    rounds.append(_round_json(rng, flavor, number, accepted, refused, direction, rel, text_words))
                written["tasks"] += 1
                final_rel = rounds[-1].get("image") or layout.attempt_image_relpath(
                    dataset, direction, stem, disease, k, status == TaskStatus.SUCCESS)
                entry = {"image": f"{stem}.jpeg", "disease": disease, "status": status, "rounds": rounds,
                         "final_prompt": rounds[-1]["generate_prompt"]["prompt"],
                         "final_image_path": f"/home/someone/Med-Banana/output/{final_rel}"}
                if flavor == "ours":
                    entry.update({"uid": f"{dataset}/{direction}/{key}", "dataset": dataset, "modality": modality,
                                  "task": direction, "source_id": stem, "source_path": source_rel,
                                  "source_sha256": source_sha, "success_round": k if status == TaskStatus.SUCCESS else None,
                                  "final_image": final_rel, "seed": int(rng.integers(2**31)),
                                  "models": {"writer": "template-writer", "editor": "simulated-editor",
                                             "judge": "pixel-judge"}})
                conversations[key] = entry
                progress[key] = status
                final_prompts[key] = {"image": entry["image"], "disease": disease, "status": status,
                                      "final_prompt": entry["final_prompt"], "rounds": k}
                if status == TaskStatus.FAILED:
                    failed_summary.append({"task": key, "image": entry["image"], "disease": disease,
                                           "final_prompt": entry["final_prompt"], "rounds": k,
                                           "last_verification": rounds[-1]["verification"],
                                           "final_image_path": entry["final_image_path"],
                                           "full_conversation": rounds})
            for name, value in ((layout.ALL_CONVERSATIONS, conversations), (layout.PROGRESS, progress),
                                (layout.FINAL_PROMPTS, final_prompts), (layout.API_FAILURES, api_failures)):
                (out_dir / name).write_text(json.dumps(value, indent=2), encoding="utf-8")
            (layout.failed_dir(run_dir, dataset, direction) / layout.FAILED_SUMMARY).write_text(
                json.dumps(failed_summary, indent=2), encoding="utf-8")
    if flavor == "ours":
        _write_our_top_level(run_dir, sources_dir, max_rounds, written)
    return written


def _round_json(rng, flavor: str, number: int, accepted: bool, refused: bool, direction: str, rel: str,
                text_words: int) -> dict:
    has_disease = accepted if direction == "add" else not accepted
    verdict = {"qualified": accepted, "has_disease": has_disease,
               "structure_reasonable": accepted or bool(rng.random() < 0.6),
               "looks_realistic": accepted or bool(rng.random() < 0.5),
               "reason": _text(rng, text_words), "thinking_summary": _text(rng, text_words * 4)}
    raw = {"round": number,
           "generate_prompt": {"thinking_summary": _text(rng, text_words * 4), "prompt": _text(rng, text_words * 2)},
           "edit_result": {"success": not refused}, "verification": None if refused else verdict}
    if flavor == "ours":
        if refused:
            raw["edit_result"]["error"] = "IMAGE_SAFETY: the editor returned no image"
        else:
            verdict.update({"fidelity_preserved": accepted or bool(rng.random() < 0.7),
                            "score": round(float(rng.uniform(0.7, 1.0) if accepted else rng.uniform(0, 0.7)), 4),
                            "model": "pixel-judge", "details": {"ssim_outside": 0.93}})
        raw.update({"instruction": raw["generate_prompt"]["prompt"], "accepted": accepted,
                    "image": None if refused else rel, "seconds": 0.25,
                    "usage": {"writer": {"input_tokens": 10, "output_tokens": 20, "thinking_tokens": 0},
                              "judge": None if refused else {"input_tokens": 30, "output_tokens": 5,
                                                             "thinking_tokens": 0}}})
    return raw


def _write_our_top_level(run_dir: Path, sources_dir: Path | None, max_rounds: int, written: dict) -> None:
    config = {"format_version": 1, "sources_root": str(Path(sources_dir).resolve()) if sources_dir else None,
              "backends": {"writer": "simulator", "editor": "simulator", "judge": "simulator"},
              "max_rounds": max_rounds}
    (run_dir / layout.RUN_CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")
    (run_dir / layout.STATS).write_text(json.dumps(written, indent=2), encoding="utf-8")
    (run_dir / layout.SOURCES_MANIFEST).write_text(json.dumps({"sources": "synthetic"}), encoding="utf-8")
    (run_dir / layout.JOURNAL).write_text('{"event": "ignored by the builder"}\n', encoding="utf-8")
