"""The recipe commands that README.md, docs/train.md and the recipes' own docstrings show are the ones the code
accepts: every GPU command parses (model swapped for a tiny folder, float32, CPU) with each option landing where it
says, and the CPU commands of docs/train.md's offline-demo section run as written, in a subprocess, with no
FutureWarning."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="training needs the train extra: pip install 'medbanana[train]'")
pytest.importorskip("diffusers", reason="training needs the train extra: pip install 'medbanana[train]'")

from medbanana.dpo import editor_diffusion_dpo, judge_sft, refiner_dpo  # noqa: E402
from medbanana.dpo.common import model_location  # noqa: E402
from paths import ROOT

pytestmark = pytest.mark.slow

RECIPES = {module.__name__: module for module in (refiner_dpo, judge_sft, editor_diffusion_dpo)}
SWAPPED = {"--model_name_or_path", "--dataset_name", "--output_dir", "--dtype"}


def documented_commands(text: str, launcher: str) -> list[tuple[str, list[str]]]:
    """(module, arguments) of every `LAUNCHER -m medbanana.dpo.NAME ...` line, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in joined.splitlines():
        match = re.match(rf"\s*{re.escape(launcher)} -m (medbanana\.dpo\.\w+) (.*)", line)
        if match:
            found.append((match[1], shlex.split(match[2], comments=True)))
    return found


TRAIN_PAGE = "docs/train.md"


def gpu_commands() -> list[tuple[str, str, list[str]]]:
    sources = {page: (ROOT / page).read_text() for page in ("README.md", TRAIN_PAGE)}
    sources.update({name: module.__doc__ for name, module in RECIPES.items()})
    return [(where, module, argv) for where, text in sources.items()
            for module, argv in documented_commands(text, "accelerate launch")]


def options(argv: list[str]) -> dict[str, list[str]]:
    """`--name v1 v2` -> {"--name": ["v1", "v2"]}; a flag alone gets []."""
    out, name = {}, None
    for word in argv:
        if word.startswith("--"):
            name = word
            out[name] = []
        else:
            out[name].append(word)
    return out


def parsed_value(parsed: tuple, name: str):
    for dataclass_values in parsed:
        if hasattr(dataclass_values, name):
            return getattr(dataclass_values, name)
    raise AssertionError(f"--{name} was accepted but no argument dataclass has it")


def test_the_train_page_and_docstrings_show_a_gpu_command_for_each_recipe():
    shown = {(where, module) for where, module, _ in gpu_commands()}
    assert {(where, name) for name in RECIPES for where in (TRAIN_PAGE, name)} <= shown
    assert {where for where, _ in shown} == {TRAIN_PAGE, "README.md", *RECIPES}  # the README shows one, parsed too


@pytest.mark.parametrize("where,module,argv", gpu_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_documented_gpu_command_parses_with_each_option_where_it_says(where, module, argv, checkpoint,
                                                                           demo_dataset, tmp_path):
    recipe = RECIPES[module]
    vlm = recipe is not editor_diffusion_dpo
    model = checkpoint("llava" if vlm else "instruct_pix2pix")
    swapped = ["--model_name_or_path", str(model), "--dataset_name", str(demo_dataset), "--output_dir",
               str(tmp_path / "out")] + (["--dtype", "float32", "--use_cpu", "true"] if vlm else [])
    parsed = recipe.make_parser().parse_args_and_config(argv + swapped)
    for option, values in options(argv).items():
        if option in SWAPPED:
            continue
        value = parsed_value(parsed, option[2:])
        if isinstance(value, bool):
            assert value == (values in ([], ["true"], ["True"])), option
        elif isinstance(value, list):
            assert value == values, option
        else:
            (text,) = values
            assert value == type(value)(text), option
    if vlm:  # the LoRA modules exist in the model, the sizes fit: the trainer builds
        trainer = recipe.build_trainer(*parsed)
        assert trainer.args.max_length == int(options(argv)["--max_length"][0])


def readme_cpu_commands() -> list[tuple[str, list[str]]]:
    section = (ROOT / TRAIN_PAGE).read_text().split("## From the offline demo, on a CPU")[1].split("\n## ")[0]
    assert "medbanana demo --out demo-run" in section
    return documented_commands(section, "python")


def test_readme_demo_section_trains_all_three_on_the_dataset_the_demo_built():
    commands = readme_cpu_commands()
    assert sorted(module for module, _ in commands) == sorted(RECIPES)
    assert all(options(argv)["--dataset_name"] == ["demo-run/dataset"] for _, argv in commands)


@pytest.mark.parametrize("module,argv", readme_cpu_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_readme_demo_commands_run_as_written(module, argv, demo_run_root, tmp_path):
    """Run from the folder that holds demo-run/, as a user following docs/train.md would; outputs go under tmp_path."""
    argv = [str(tmp_path / Path(word).name) if word.startswith("/tmp/") else word for word in argv]
    out = Path(options(argv)["--output_dir"][0])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=demo_run_root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FutureWarning" not in done.stderr, done.stderr[-3000:]
    assert "saved the trained" in done.stdout and str(out) in done.stdout
    assert (out / "tiny-random-base").is_dir()  # tiny-random went through a saved folder
    saved = "model_index.json" if module.endswith("editor_diffusion_dpo") else "model.safetensors"
    assert (out / saved).is_file()


def test_a_dataset_that_is_not_there_is_named_as_missing(demo_run_root):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # a bare name is tried on the Hub; offline it is not found at once
    for name, says in (("demo-datasett", "'demo-datasett' is not a folder in"),
                       ("./demo-run/datasett", "no dataset folder at ./demo-run/datasett")):
        done = subprocess.run([sys.executable, "-m", "medbanana.dpo.refiner_dpo", "--dataset_name", name,
                               "--model_name_or_path", "tiny-random", "--output_dir", "out", "--use_cpu"],
                              cwd=demo_run_root, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and f"error: {says}" in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
    assert not (demo_run_root / "out").exists()


def test_a_model_folder_that_is_not_there_is_named_as_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model folder at ./missing-model"):
        model_location("./missing-model", tmp_path, lambda folder: None)
    assert model_location("Qwen/Qwen2.5-VL-3B-Instruct", tmp_path, lambda folder: None) == \
        "Qwen/Qwen2.5-VL-3B-Instruct"  # a Hub id goes to from_pretrained as it is


@pytest.mark.parametrize("given,expected", [([], False), (["--trust_remote_code"], True)])
def test_trust_remote_code_is_off_unless_asked_and_reaches_both_loaders(given, expected, checkpoint, demo_dataset,
                                                                        tmp_path, monkeypatch):
    import transformers

    seen = []
    for name in ("AutoModelForImageTextToText", "AutoProcessor"):
        cls = getattr(transformers, name)
        original = cls.from_pretrained.__func__

        def spy(klass, *args, _original=original, _name=name, **kwargs):
            seen.append((_name, kwargs.get("trust_remote_code")))
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    parsed = judge_sft.make_parser().parse_args_and_config(
        ["--dataset_name", str(demo_dataset), "--model_name_or_path", str(checkpoint("llava")), "--output_dir",
         str(tmp_path / "out"), "--use_cpu", "--bf16", "false", "--max_samples", "2", *given])
    assert parsed[1].trust_remote_code is expected
    judge_sft.build_trainer(*parsed)
    assert sorted(seen) == [("AutoModelForImageTextToText", expected), ("AutoProcessor", expected)]
