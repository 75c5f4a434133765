"""The layout ARCHITECTURE.md describes holds: imports run one way between the stages, and modules stay small."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("generation", "builder", "loaders", "dpo", "evaluation", "review")

# area -> the areas it may import (besides itself). The generation base is records, taxonomy, prompts, files and
# secrets (and extras); then records/taxonomy/prompts <- backends <- loop <- runners <- commands, with the run directory's
# contract (rundir) and the sources below the runners; the builder reads run directories, evaluation reads both.
BASE = {"generation.records", "generation.taxonomy", "generation.prompts", "generation.files", "generation.secrets",
        "generation.extras", "generation.failures", "generation.anatomy", "generation.raster",
        "generation.masks", "generation.acceptance", "generation.destinations", "generation.mask_check",
        "generation.interrupts", "generation.pricing", "generation.costs", "generation.geometry",
        "generation.registration", "generation.vocabulary", "generation.pools"}
ALLOWED = {
    **{area: BASE for area in BASE},
    "generation.rundir": BASE,
    "generation.backends": BASE,
    "generation.sources": BASE | {"generation.rundir"},
    "generation.loop": BASE | {"generation.backends"},
    "generation.runners": BASE | {"generation.backends", "generation.loop", "generation.rundir", "generation.sources"},
    "generation.testing": BASE | {"generation.backends"},
    "generation.commands": BASE | {"generation.backends", "generation.loop", "generation.rundir", "generation.runners",
                                   "generation.sources"},
    # above the stages: a command that spans two of them (generate, then build)
    "demo": BASE | {"generation.commands", "generation.runners", "generation.rundir", "generation.backends",
                    "builder"},
    "export": BASE | {"builder", "loaders"},  # `medbanana export`: reads built datasets (loaders/medebench.py)
    "builder": BASE | {"generation.rundir", "package"},
    "loaders": BASE | {"generation.rundir", "builder"},
    "medbanana_50k": {"builder"},
    "evaluation": BASE | {"generation.rundir", "generation.backends", "builder"},
    "dpo": BASE | {"generation.backends", "loaders"},
    # review: its store writes the folder whose read contract is the builder's (builder/review_folder.py, what
    # `--reviews` reads); the rest reads datasets and runs through evaluation's inputs and reports with its agreement
    # helpers
    "review.store": BASE | {"builder"},
    "review": BASE | {"generation.rundir", "builder", "evaluation", "review.store"},
}


def module_name(path: Path) -> str:
    parts = ["medbanana", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def area(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "package"
    if parts[0] == "generation":
        return "generation." + parts[1] if len(parts) > 1 else "generation"
    if parts[:2] == ["review", "store"]:
        return "review.store"
    return parts[0]


def imported_modules(path: Path) -> set[str]:
    """Every medbanana module `path` imports; `from PKG import name` counts PKG.name when that is a module."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                as_module = f"{target}.{alias.name}"
                found.add(as_module if _is_module(as_module) else target)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.split(".")[0] == "medbanana"}


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (ROOT / rel.with_suffix(".py")).exists() or (ROOT / rel / "__init__.py").exists()


def package_files() -> list[Path]:
    files = [ROOT / "medbanana_50k.py", ROOT / "demo.py", ROOT / "export.py"]
    for folder in PACKAGE_DIRS:
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def test_the_parser_sees_relative_and_absolute_imports(tmp_path):
    runner = ROOT / "generation" / "runners" / "local.py"
    assert "medbanana.generation.loop" in imported_modules(runner)
    assert "medbanana.generation.rundir.layout" in imported_modules(ROOT / "builder" / "runs.py")


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    mine = area(module_name(path))
    if mine not in ALLOWED:  # the generation package's own __init__
        return
    wrong = sorted(m for m in imported_modules(path) if area(m) != mine and area(m) not in ALLOWED[mine]
                   and area(m) != "generation")
    assert not wrong, f"{path.relative_to(ROOT)} ({mine}) imports {wrong}: against the direction in ARCHITECTURE.md"


def test_modules_stay_under_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in package_files() + [ROOT / "cli.py"]
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these modules: {long}"


def test_every_stage_folder_is_in_architecture_md():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    folders = sorted(p.parent.relative_to(ROOT) for p in (ROOT / "generation").rglob("__init__.py"))
    # a stage folder has its row (`generation/backends/`); a folder inside one is named in that row (`simulator/`)
    missing = [str(f) for f in folders
               if f"`{f}/`" not in text and not (len(f.parts) > 2 and f"`{f.parts[-1]}/`" in text)]
    assert not missing, f"ARCHITECTURE.md names no row for {missing}"


def test_tests_mirror_the_package_folders():
    test_folders = {p.parent.relative_to(ROOT / "tests") for p in (ROOT / "tests").rglob("test_*.py")}
    strays = sorted(str(f) for f in test_folders if f != Path(".") and not (ROOT / f / "__init__.py").exists())
    assert not strays, f"tests/{strays} match no package folder"
