"""Every command and recipe, run with one optional dependency missing, ends with one line naming the pip extra to
install (exit 2), never a traceback; where the dependency is only needed for part of the output (Figure 3), the rest
is written and the missing part is named in one line.

Each case is a real process: `tests/hide_modules.py` marks the modules as absent (`sys.modules[name] = None`, which is
what an uninstalled package looks like to `import` and to `importlib.util.find_spec`), then runs the `medbanana`
command or `python -m medbanana.dpo.RECIPE` exactly as a user types it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HIDE = Path(__file__).resolve().parent / "hide_modules.py"


def run_without(modules: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HIDE), modules, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def one_line_naming(result: subprocess.CompletedProcess, extra: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in lines if "pip install" in line]
    assert len(errors) == 1, result.stderr
    assert f"pip install 'medbanana[{extra}]'" in errors[0] and f"pip install '.[{extra}]'" in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def demo(demo_run_root) -> Path:
    return demo_run_root / "demo-run"


# (hidden modules, extra named, argv with {run}, {dataset}, {sources}, {out} filled in)
COMMANDS = [
    ("openai", "openai", ["generate", "--sources", "{sources}", "--out", "{out}", "--writer", "openai", "-q"]),
    ("diffusers", "train", ["generate", "--sources", "{sources}", "--out", "{out}", "--editor", "diffusers", "-q"]),
    ("ray", "ray", ["generate", "--sources", "{sources}", "--out", "{out}", "--executor", "ray", "--shards", "2"]),
    ("torchxrayvision", "probes-xray",
     ["eval", "{run}", "--out", "{out}", "--source-images", "{sources}", "--judge", "none", "--classifier",
      "torchxrayvision:densenet121-res224-all"]),
    ("timm", "probes-pretrained",
     ["eval", "{run}", "--out", "{out}", "--source-images", "{sources}", "--judge", "none", "--separability",
      "--probe-features", "timm:resnet18"]),
    ("open_clip", "probes-pretrained", ["eval", "{run}", "--out", "{out}", "--source-images", "{sources}", "--judge",
                                        "none", "--separability", "--probe-features", "open_clip:ViT-B-32/model.bin"]),
    ("cryptography", "c2pa", ["keys", "init", "{out}"]),
    ("c2pa", "c2pa", ["verify", "{dataset}", "--c2pa"]),
    ("gradio", "review", ["review", "{run}", "--out", "{out}", "--items", "4"]),
    ("torch", "train", ["-m", "medbanana.dpo.refiner_dpo", "--dataset_name", "{dataset}",
                        "--model_name_or_path", "tiny-random", "--output_dir", "{out}"]),
    ("trl", "train", ["-m", "medbanana.dpo.judge_sft", "--dataset_name", "{dataset}",
                      "--model_name_or_path", "tiny-random", "--output_dir", "{out}"]),
    ("diffusers", "train", ["-m", "medbanana.dpo.editor_diffusion_dpo", "--dataset_name", "{dataset}",
                            "--model_name_or_path", "tiny-random", "--output_dir", "{out}"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("modules, extra, argv", COMMANDS, ids=[f"{c[2][0] if c[2][0] != '-m' else c[2][1]}"
                                                                  f"-without-{c[0]}" for c in COMMANDS])
def test_a_missing_extra_is_one_line_naming_it(demo, tmp_path, modules, extra, argv):
    out = tmp_path / "out"
    filled = [a.format(run=demo / "run", dataset=demo / "dataset", sources=demo / "sources", out=out) for a in argv]
    result = run_without(modules, *filled, cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr)
    one_line_naming(result, extra)
    assert not out.exists(), "a command that cannot run must not leave a half-made output folder"


@pytest.mark.slow
def test_review_report_without_krippendorff_is_one_line(demo, tmp_path):
    made = subprocess.run([sys.executable, "-m", "medbanana", "review", str(demo / "run"), "--out",
                           str(tmp_path / "review"), "--items", "4", "--no-serve", "--source-images",
                           str(demo / "sources")], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    result = run_without("krippendorff", "review", "report", str(tmp_path / "review"), "--out",
                         str(tmp_path / "report"), cwd=tmp_path)
    assert result.returncode == 2
    one_line_naming(result, "review")


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["stats", "{run}", "--out", "{out}"], ["build", "{run}", "--out", "{out}"]])
def test_without_matplotlib_only_figure3_is_left_out_in_one_line(demo, tmp_path, argv):
    out = tmp_path / "out"
    result = run_without("matplotlib", *[a.format(run=demo / "run", out=out) for a in argv], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    said = [line for line in (result.stdout + result.stderr).splitlines() if "pip install" in line]
    assert len(said) == 1 and "matplotlib" in said[0] and "pip install 'medbanana[eval]'" in said[0], said
    assert not said[0].lstrip().startswith(("/", "File ")) and ".py:" not in said[0]  # no source line shown
    assert not (out / "figure3.png").exists()
    assert (out / ("table1.md" if argv[0] == "stats" else "README.md")).is_file()
