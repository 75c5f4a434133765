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
        "generation.registration", "generation.vocabulary", "generation.tables", "generation.guarantee",
        "generation.outcomes", "generation.pools"}
ALLOWED = {
    **{area: BASE for area in BASE},
    "generation.rundir": BASE,  # the run directory's contract: its names, its writer's files, its readers
    "generation.dataset": BASE | {"generation.rundir"},  # the dataset and review folders' contracts
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
    "export": BASE | {"generation.dataset", "loaders"},  # `medbanana export`: reads built datasets (loaders/medebench.py)
    "builder": BASE | {"generation.rundir", "generation.dataset", "package"},
    "loaders": BASE | {"generation.rundir", "generation.dataset"},
    # the loading builder: the builder's row iterators over the run readers
    "medbanana_50k": BASE | {"builder", "generation.rundir", "generation.dataset"},
    "evaluation": BASE | {"generation.rundir", "generation.dataset", "generation.backends"},
    "dpo": BASE | {"generation.backends", "loaders"},
    # review: its store writes the folder whose read contract is generation/dataset/review_folder.py (what
    # `build --reviews` reads); the rest reads datasets and runs through evaluation's inputs and reports with its
    # agreement helpers
    "review.store": BASE | {"generation.dataset"},
    "review": BASE | {"generation.rundir", "generation.dataset", "evaluation", "review.store"},
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
    assert "medbanana.generation.rundir.layout" in imported_modules(ROOT / "generation" / "rundir" / "runs.py")


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    mine = area(module_name(path))
    if mine not in ALLOWED:  # the generation package's own __init__
        return
    wrong = sorted(m for m in imported_modules(path) if area(m) != mine and area(m) not in ALLOWED[mine]
                   and area(m) != "generation")
    assert not wrong, f"{path.relative_to(ROOT)} ({mine}) imports {wrong}: against the direction in ARCHITECTURE.md"


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a longer loop (Tarjan's strongly connected
    components of more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1 or node in graph.get(node, ()):
                    found.append(sorted(group))
    return found


def test_the_cycle_finder_finds_loops_of_any_length():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"a"}, "b": set()}) == [["a"]]
    assert import_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_module_imports_itself_round_a_loop():
    """No file-level import cycle, counting imports made inside functions (a cycle dodged by importing late is
    still one) and under TYPE_CHECKING."""
    graph = {module_name(p): imported_modules(p) for p in package_files() + [ROOT / "cli.py"]}
    graph = {module: {m for m in found if m in graph and m != module} for module, found in graph.items()}
    assert "medbanana.generation.rundir.readers" in graph["medbanana.generation.rundir.runs"]  # the parser sees them
    assert not import_cycles(graph), f"modules that import each other: {import_cycles(graph)}"


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


def _own_and_imported(path: Path) -> tuple[set[str], set[str]]:
    """The top-level names a module defines, and those it imports (under `if`/`try` too)."""
    own, imported = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return own, imported - own


def test_names_are_imported_from_their_home():
    """No re-exports: a name is imported from the module that declares it, not from one that imported it (a
    package's __init__, its public face, aside)."""
    files = package_files() + [ROOT / "cli.py"] + sorted((ROOT / "tests").rglob("*.py")) + sorted(
        (ROOT / "bench").glob("*.py"))
    names = {module_name(p): _own_and_imported(p) for p in package_files() + [ROOT / "cli.py"]
             if p.name != "__init__.py"}
    wrong = []
    for path in files:
        module = "" if path.is_relative_to(ROOT / "tests") else module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            if source in names:
                wrong += [f"{path.relative_to(ROOT)}: {a.name} from {source}" for a in node.names
                          if a.name in names[source][1] and not _is_module(f"{source}.{a.name}")]
    assert not wrong, f"import these from the module that declares them: {wrong}"
