"""Issue 14 item 6: documented exit codes with the top reasons on stderr, masks of any encoding, the CP mean
saying what it leaves out, MedEBench's reading of 16-bit images. Through the real CLI (`main` and a subprocess)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import write_jpeg
from medbanana.cli import main
from medbanana.evaluation import metrics
from medbanana.generation.testing.fake_gemini import FakeGemini

KEY = "exit-codes-key-3f1a"
EXIT_INCOMPLETE = 3  # the documented code (evaluation/failures.py, docs/exit-codes.md), pinned here on purpose


@pytest.fixture(scope="module")
def fake():
    with FakeGemini(engine="echo") as server:
        yield server


@pytest.fixture
def sources(tmp_path) -> Path:
    root = tmp_path / "sources"
    for i in range(2):
        write_jpeg(root / "MIMIC_exit" / "normal" / f"n{i}.jpeg", i, size=64)
    return root


def _generate(sources: Path, out: Path, *extra: str) -> list[str]:
    return ["generate", "--sources", str(sources), "--out", str(out), "--backend", "gemini", "--diseases", "Pneumothorax", "--max-rounds",
            "1", "--max-attempts", "1", "--retry-base-delay", "0.01", "--timeout", "5", "-q", *extra]


# ---------------------------------------------------------------- generate

@pytest.mark.slow
def test_generate_exits_3_with_top_reasons_when_every_task_ended_api_failed(fake, sources, tmp_path, monkeypatch,
                                                                            capfd):
    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", fake.base_url)
    run_dir = tmp_path / "run"
    fake.reset(["500:role=writer"])  # every writer call fails
    assert main(_generate(sources, run_dir)) == EXIT_INCOMPLETE
    err = capfd.readouterr().err
    assert "2 of 2 tasks ended api_failed" in err
    assert "server_error at generate_prompt" in err  # kind and step of the failure, with its count
    assert f"--retry-failed {run_dir}" in err and KEY not in err

    fake.reset()  # a plain rerun skips the recorded failures: the run directory is still incomplete
    assert main(_generate(sources, run_dir)) == EXIT_INCOMPLETE
    capfd.readouterr()
    assert main(_generate(sources, run_dir, "--retry-failed", str(run_dir))) == 0  # fault gone: all finished
    assert "api_failed" not in capfd.readouterr().err


@pytest.mark.slow
def test_generate_exit_code_reaches_the_shell_for_an_unreachable_endpoint(sources, tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "GEMINI_API_KEY": KEY, "GOOGLE_GEMINI_BASE_URL": f"http://127.0.0.1:{port}"}
    done = subprocess.run([sys.executable, "-m", "medbanana", *_generate(sources, tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == EXIT_INCOMPLETE, done.stderr
    assert "tasks ended api_failed" in done.stderr and "at generate_prompt" in done.stderr


# ---------------------------------------------------------------- eval: failures

def png(path: Path, image: Image.Image | np.ndarray) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(path)
    return path.name


def textured(size: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def manifest(folder: Path, rows: list[dict]) -> Path:
    base = {"instruction": "Add a small pleural effusion.", "disease": "Pleural_Effusion", "direction": "add"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "samples.jsonl").write_text("".join(json.dumps({**base, **r}) + "\n" for r in rows))
    return folder


def run_eval(folder: Path, out: Path, capfd, *extra: str) -> tuple[int, str, str]:
    code = main(["eval", str(folder), "--out", str(out), "--judge", "none", "--no-lpips", "-q", *extra])
    captured = capfd.readouterr()
    return code, captured.out, captured.err


def test_eval_exits_3_with_reasons_when_every_sample_failed_and_its_line_has_no_dangling_separator(tmp_path, capfd):
    folder = tmp_path / "eval"
    png(folder / "src.png", textured())
    folder = manifest(folder, [{"id": f"s{i}", "source": "src.png", "edited": f"model/s{i}.png"} for i in range(3)])
    code, out, err = run_eval(folder, tmp_path / "out", capfd)
    assert code == EXIT_INCOMPLETE
    assert "3 of 3 samples could not be scored" in err and "no sample could be scored" in err
    assert "3  file not found: edited …" in err  # grouped although each names another file
    line = out.splitlines()[0]
    assert line == "0 samples scored, 3 errors, 0 judge errors"  # no dangling "; "
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (first,) = summary["failure_reasons"]["errors"]
    assert (first["reason"], first["samples"]) == ("file not found: edited …", 3)
    assert first["example"].endswith("model/s0.png")  # the file its first sample named
    assert f"3  file not found: edited … (e.g. {first['example']})" in err
    assert "## Samples not scored: top reasons" in (tmp_path / "out" / "report.md").read_text()


def test_eval_with_some_failures_exits_0_but_counts_them_with_reasons(tmp_path, capfd):
    folder = tmp_path / "eval"
    png(folder / "src.png", textured())
    png(folder / "broken.png", textured(seed=1))
    (folder / "broken.png").write_bytes(b"not an image at all")
    folder = manifest(folder, [{"id": "good", "source": "src.png", "edited": "src.png"},
                               {"id": "bad", "source": "src.png", "edited": "broken.png"}])
    code, out, err = run_eval(folder, tmp_path / "out", capfd)
    assert code == 0
    assert "1 of 2 samples could not be scored" in err and "not a readable image" in err
    assert out.startswith("1 samples scored, 1 errors, 0 judge errors; CP 1.000")


def test_eval_exits_3_when_a_judge_was_asked_for_and_gave_no_verdict(fake, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    fake.reset(["invalid_argument:role=judge"])  # a 400: not retried
    folder = tmp_path / "eval"
    png(folder / "src.png", textured())
    folder = manifest(folder, [{"id": "a", "source": "src.png", "edited": "src.png"}])
    code = main(["eval", str(folder), "--out", str(tmp_path / "out"), "--judge", "gemini", "--base-url",
                 fake.base_url, "--no-lpips", "-q"])
    err = capfd.readouterr().err
    assert code == EXIT_INCOMPLETE and fake.count("judge") >= 1
    assert "1 of 1 samples have no verdict" in err and "the judge gave no verdict for any sample" in err
    assert KEY not in err


# ---------------------------------------------------------------- eval: masks of any encoding

def _mask(kind: str, roi: np.ndarray) -> Image.Image:
    one = roi.astype(np.uint8)
    if kind == "L 0/1":
        return Image.fromarray(one)
    if kind == "RGB red":
        return Image.fromarray(np.stack([one * 255, one * 0, one * 0], axis=-1))
    if kind == "P palette":  # VOC-style: index 1 is dark red
        im = Image.fromarray(one, "P")
        im.putpalette([0, 0, 0, 128, 0, 0] + [0] * 762)
        return im
    if kind == "P no palette":
        im = Image.new("P", one.shape[::-1])
        im.putdata(one.ravel().tolist())
        return im
    if kind == "16-bit 0/1":
        return Image.fromarray(one.astype(np.uint16))
    if kind == "RGBA alpha":
        return Image.fromarray(np.dstack([np.zeros(roi.shape + (3,), np.uint8), one * 255]), "RGBA")
    raise AssertionError(kind)


MASK_KINDS = ["L 0/1", "RGB red", "P palette", "P no palette", "16-bit 0/1", "RGBA alpha"]


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_binary_masks_of_any_encoding_are_read_as_masks(tmp_path, capfd, kind):
    source = textured(seed=2)
    roi = np.zeros(source.shape[:2], bool)
    roi[10:30, 12:34] = True
    edited = source.copy()
    edited[roi] = textured(seed=3)[roi]  # an edit confined to the ROI: CP 1 when the mask is read
    folder = tmp_path / "eval"
    png(folder / "src.png", source), png(folder / "edit.png", edited), png(folder / "mask.png", _mask(kind, roi))
    folder = manifest(folder, [{"id": "a", "source": "src.png", "edited": "edit.png", "mask": "mask.png"}])
    assert run_eval(folder, tmp_path / "out", capfd)[0] == 0
    (record,) = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert record["roi_fraction"] == pytest.approx(roi.mean(), abs=1e-5)
    assert record["cp"] == pytest.approx(1.0, abs=1e-9)
    assert record["mask_read"] != "empty"


def test_boolean_and_0_1_masks_through_the_api_are_masks():
    source = textured(seed=4)
    roi = np.zeros(source.shape[:2], bool)
    roi[8:28, 8:28] = True
    edited = source.copy()
    edited[roi] = 255 - edited[roi]
    for mask in (roi, roi.astype(np.uint8), roi.astype(np.float32)):
        for mode in metrics.CP_MODES:
            assert metrics.context_preservation(source, edited, mask, mode) == pytest.approx(1.0, abs=1e-9)
        assert metrics.pixel_metrics(source, edited, mask, cp_mode="correct")["cp"] == pytest.approx(1.0, abs=1e-9)


# ---------------------------------------------------------------- eval: CP exclusions, 16-bit

def test_a_full_mask_is_excluded_from_the_cp_mean_and_the_exclusion_is_stated(tmp_path, capfd):
    source = textured(seed=5)
    edited = source.copy()
    edited[:4] = 0  # CP < 1 where the ROI is empty
    folder = tmp_path / "eval"
    png(folder / "src.png", source), png(folder / "edit.png", edited)
    png(folder / "full.png", np.full(source.shape[:2], 255, np.uint8))
    folder = manifest(folder, [{"id": "full", "source": "src.png", "edited": "edit.png", "mask": "full.png"},
                               {"id": "none", "source": "src.png", "edited": "edit.png"}])
    code, out, _ = run_eval(folder, tmp_path / "out", capfd, "--roi", "auto")
    assert code == 0
    assert "(over 1 of 2: 1 excluded, CP undefined for a full ROI)" in out.splitlines()[0]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["cp_excluded"]["samples"], summary["cp_excluded"]["of"]) == (1, 2)
    assert summary["overall"]["CP excluded"] == 1
    report = (tmp_path / "out" / "report.md").read_text()
    assert "CP mean over 1 of 2 scored samples, 1 excluded as undefined: 1 where no 7x7" in report
    records = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records if r.get("cp_excluded")] == ["full"]


def test_medebench_mode_reads_16_bit_sources_as_medebench_does(tmp_path, capfd):
    rng = np.random.default_rng(6)
    wide = rng.integers(0, 600, (48, 48)).astype(np.uint16)  # most values above 255: clipped by MedEBench
    edited = np.repeat(np.clip(wide, 0, 255).astype(np.uint8)[..., None], 3, axis=2)
    edited[30:40, 30:40] = 0
    mask = np.zeros((48, 48), np.uint8)
    mask[5:15, 5:15] = 255
    folder = tmp_path / "eval"
    png(folder / "src.png", Image.fromarray(wide)), png(folder / "edit.png", edited), png(folder / "mask.png", mask)
    folder = manifest(folder, [{"id": "a", "source": "src.png", "edited": "edit.png", "mask": "mask.png"}])
    assert Image.open(folder / "src.png").mode == "I;16"
    assert run_eval(folder, tmp_path / "out", capfd, "--cp-mode", "medebench")[0] == 0
    (record,) = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    as_medebench = np.asarray(Image.open(folder / "src.png").convert("RGB"))
    assert record["cp"] == pytest.approx(metrics.cp_medebench(as_medebench, edited, mask), abs=1e-12)
    assert record["psnr"] == pytest.approx(metrics.psnr_rgb(as_medebench, edited), abs=1e-9)
    # the default mode keeps min-max scaling, as documented in the metrics module
    assert run_eval(folder, tmp_path / "correct", capfd)[0] == 0
    assert "min–max scaled" in metrics.__doc__ and "clips values" in metrics.__doc__
