"""What the README, the pages under docs/, ARCHITECTURE.md and docstrings say about the code is checked against it:
every repository file they name exists, every module, class and function they name by its dotted name
(`generation.rundir.lock.LockHeld`, `records.Verdict`) or its file name (`schema.py`) exists, every link of the README
leads to a file, every `medbanana` subcommand they show is one the CLI has, and the loading builder's docstring
example runs as written. (tests/test_docs_commands.py runs the commands themselves.)"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import io
import re
import textwrap
import tokenize
from functools import cache
from pathlib import Path

import pytest
from paths import ROOT

DOCS = ("README.md", "ARCHITECTURE.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")))
# a path inside the repository: a known top-level folder, then names; written in backticks or after "see"
REPO_PATH = re.compile(r"(?<![\w./-])((?:generation|builder|evaluation|review|loaders|dpo|bench|tests|docs)/[\w./-]*\w)")


def repository_paths(text: str) -> set[str]:
    found = set()
    for match in REPO_PATH.finditer(text):
        path = match.group(1)
        if "*" in path or "{" in path or path.endswith((".parquet", ".jpeg", ".jpg", ".png")):
            continue
        found.add(path)
    return found


def test_the_path_pattern_finds_what_the_docs_name():
    named = {doc: repository_paths((ROOT / doc).read_text(encoding="utf-8")) for doc in DOCS}
    assert len(named["ARCHITECTURE.md"]) > 5 and sum(map(len, named.values())) > 40, \
        "the pattern found too few paths to be checking anything"
    assert "docs/make_figure.py" in named["README.md"] and "bench/extras_sizes.py" in named["docs/install.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_repository_file_the_docs_name_exists(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = sorted(p for p in repository_paths(text) if not (ROOT / p).exists() and not (ROOT / (p + ".py")).exists())
    assert not missing, f"{doc} names files that are not in the repository: {missing}"


def test_every_link_of_the_readme_leads_to_a_file():
    """The README is read on the forge, not in the built site (whose links `mkdocs build --strict` checks)."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text(encoding="utf-8"))
    local = [link for link in links if "://" not in link]
    assert len(local) > 10 and "docs/images/demo-grid.png" in local
    assert not [link for link in local if not (ROOT / link).is_file()]


def test_the_code_names_no_moved_module():
    """Messages and reports that name a module of ours name one that exists (the simulator's scores moved once)."""
    stale = []
    for path in ROOT.rglob("*.py"):
        if ".venv" in path.parts or "tests" in path.parts:
            continue
        for match in re.finditer(r"medbanana/((?:generation|builder|evaluation|review|loaders|dpo)/[\w/]+\.py)",
                                 path.read_text(encoding="utf-8")):
            if not (ROOT / match.group(1)).is_file():
                stale.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not stale, stale


def test_every_subcommand_the_docs_show_exists(capsys):
    from medbanana.cli import build_parser

    code = "\n".join(block for doc in DOCS  # the docs' code blocks
                     for block in re.findall(r"(?ms)^```[^\n]*\n(.*?)^```", (ROOT / doc).read_text(encoding="utf-8")))
    shown = set(re.findall(r"(?m)^\s*(?:\$ )?medbanana ([a-z][a-z-]+)", code))
    assert len(shown) > 10, "too few `medbanana COMMAND` lines found in the docs"
    unknown = []
    for command in sorted(shown):
        with pytest.raises(SystemExit) as exit_:  # --help exits 0; an unknown command is a usage error (2)
            build_parser().parse_args([command, "--help"])
        if exit_.value.code != 0:
            unknown.append(command)
    capsys.readouterr()
    assert not unknown, f"the docs show commands the CLI does not have: {unknown}"


@pytest.mark.slow
def test_the_loading_builder_docstring_example_runs_as_written(demo_run_root, monkeypatch):
    """The example in medbanana_50k.py, run in a folder holding `demo-run/` as `medbanana demo` leaves it."""
    from medbanana import medbanana_50k

    example = re.search(r"\n\n((?:    .*\n|\n)+)", medbanana_50k.__doc__)[1]
    monkeypatch.chdir(demo_run_root)
    scope: dict = {}
    exec(textwrap.dedent(example), scope)  # noqa: S102 - the docstring's own example, as a user would paste it
    assert scope["ds"].num_rows > 0 and "chosen_image" in scope["ds"].column_names


# --- dotted names and file names in prose ------------------------------------------------------------------------
# How this codebase's prose names code: a dotted name rooted at a stage, with or without backticks and `medbanana.`
# (generation.rundir.lock.LockHeld, `medbanana.generation.dataset.features.CONFIG_FEATURES`); a backticked dotted name rooted at
# one of our modules or classes (`records.Verdict`, `layout.inside`, `RunStore.journal_attempt`); a file name
# (`schema.py`, rundir/lock.py, medbanana/demo.py).
STAGES = ("generation", "builder", "evaluation", "review", "loaders", "dpo")
STAGE_DOTTED = re.compile(r"(?<![\w./-])((?:medbanana\.)?(?:%s)(?:\.\w+)+)" % "|".join(STAGES))
BACKTICKED = re.compile(r"`((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)(?:\(\))?`")
PY_FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py)\b")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "sqlite", "csv", "txt", "png", "jpeg", "jpg", "parquet", "pem", "yaml",
                 "toml", "html", "js", "sbatch", "lock"}
FOREIGN_FILES = {"evaluate_gpt4o.py", "traditional_metrics_eval.py",  # MedEBench's scripts, which export feeds
                 "src/eval_metrics/traditional_metrics_eval.py"}
SKIPPED = {".venv", ".pp", ".git", "tests", "site", "build", "dist"}  # site, build, dist: what mkdocs and pip leave


def package_sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIPPED & set(p.relative_to(ROOT).parts))


def prose(path: Path) -> str:
    """What a reader reads of a Python file: its docstrings (without their indented or >>> examples, which run as
    code) and comments; all of a Markdown page."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return text
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found += [line for line in inspect.cleandoc(doc).splitlines()
                          if not line.startswith(("    ", ">>>", "..."))]
    found += [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT]
    return "\n".join(found)


@cache
def module_file(parts: tuple[str, ...]) -> Path | None:
    if not parts:
        return ROOT / "__init__.py"
    path = ROOT.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def members(path: Path) -> dict[str, frozenset[str] | None]:
    """A module's top-level names; for a class, its own names (methods, fields, `self.x` it assigns), else None."""
    names: dict[str, frozenset[str] | None] = {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # definitions under `if`/`try` count too; nested ones are harmless extras
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(alias.asname or alias.name).split(".")[0]: None for alias in node.names})
    for node in tree.body:
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.ClassDef):
                own = {n.id for n in ast.walk(sub) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
                own |= {n.name for n in sub.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                     ast.ClassDef))}
                own |= {n.attr for n in ast.walk(sub) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                        and isinstance(n.value, ast.Name) and n.value.id == "self"}
                names[sub.name] = frozenset(own)
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[sub.name] = None
            elif isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                names.update({n.id: None for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)})
    return names


def resolves(parts: tuple[str, ...]) -> bool:
    """Whether the longest module prefix of `parts` exists and the rest is a name it defines (and, for a class, one
    of the class's own names); deeper attributes are not followed."""
    for k in range(len(parts), -1, -1):
        path = module_file(parts[:k])
        if path is None:
            continue
        rest = parts[k:]
        if not rest:
            return True
        defined = members(path)
        if rest[0] not in defined:
            return module_file(parts[:k + 1]) is not None
        own = defined[rest[0]]
        return len(rest) == 1 or own is None or rest[1] in own
    return False


@cache
def modules_by_name() -> dict[str, list[tuple[str, ...]]]:
    found: dict[str, list[tuple[str, ...]]] = {}
    for path in package_sources():
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts and parts[0] not in ("bench", "docs"):
            found.setdefault(parts[-1], []).append(parts)
    return found


@cache
def classes_by_name() -> dict[str, list[frozenset[str]]]:
    found: dict[str, list[frozenset[str]]] = {}
    for parts_list in modules_by_name().values():
        for parts in parts_list:
            for name, own in members(module_file(parts)).items():
                if own is not None:
                    found.setdefault(name, []).append(own)
    return found


def third_party(name: str) -> bool:
    """`trl.DPOTrainer` names TRL's class, not loaders/trl.py: a first word that is also an installed top-level
    module (or the standard library's: `secrets`, `http`) is ambiguous and not checked."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    origin = Path(spec.origin or "/") if spec is not None else None
    # installed, or not ours: a virtual environment may sit inside the checkout (.ci/run makes .venv there)
    return origin is not None and (ROOT not in origin.parents or "site-packages" in origin.parts)


def unresolved_names(text: str, json_keys: set[str]) -> set[str]:
    bad = set()
    named = {m[1] for m in STAGE_DOTTED.finditer(text)} | {m[1] for m in BACKTICKED.finditer(text)}
    for name in named:
        parts = tuple(name.split("."))
        if parts[-1] in FILE_SUFFIXES or parts[0] in json_keys:  # a file name (`review.sqlite`), a JSON key path
            continue
        if parts[0] == "medbanana":
            ok = resolves(parts[1:])
        elif parts[0] in STAGES:
            ok = resolves(parts)
        elif parts[0] in modules_by_name() and not third_party(parts[0]):
            ok = any(resolves((*module, *parts[1:])) for module in modules_by_name()[parts[0]])
        elif parts[0] in classes_by_name() and len(parts) == 2:
            ok = any(parts[1] in own for own in classes_by_name()[parts[0]])
        else:
            continue  # not a name of ours (`ds.num_rows`, `datasets.load_dataset`)
        if not ok and not (parts[-1].isalpha() and parts[-1].isupper()):  # `medbanana.dpo.RECIPE`: a placeholder
            bad.add(name)
    return bad


# a backticked snake_case word (`run_json`, `success_round`, `read_tasks()`) must be one the package's code knows
BARE_WORD = re.compile(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?:\(\))?`")
LIBRARY_WORDS = {"snapshot_download", "local_dir",  # huggingface_hub's, named where a download is explained
                 "trust_env"}  # aiohttp's


@cache
def known_words() -> frozenset[str]:
    """Every name the package's code defines or uses (modules, functions, classes, arguments, attributes), every word
    of its string constants (columns, JSON fields, messages), and of its JSON and text data."""
    words: set[str] = set()
    for path in package_sources():
        words.add(path.stem)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Name):
                words.add(node.id)
            elif isinstance(node, ast.Attribute):
                words.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                words.add(node.name)
            elif isinstance(node, ast.arg):
                words.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                words.add(node.arg)
            elif isinstance(node, ast.alias):
                words.update((node.asname or node.name).split("."))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                words.update(re.findall(r"\w+", node.value))
    for path in ROOT.rglob("*"):
        if path.suffix in (".json", ".txt") and not SKIPPED & set(path.relative_to(ROOT).parts):
            words.update(re.findall(r"\w+", path.read_text(encoding="utf-8")))
    return frozenset(words)


def unknown_words(text: str) -> set[str]:
    return {m[1] for m in BARE_WORD.finditer(text)} - known_words() - LIBRARY_WORDS


@cache
def repository_files() -> tuple[str, ...]:
    return tuple(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
                 if not (SKIPPED - {"tests"}) & set(p.relative_to(ROOT).parts))


def unresolved_files(text: str) -> set[str]:
    bad = set()
    for match in PY_FILE.finditer(text):
        name = match[1].removeprefix("medbanana/")
        if name not in FOREIGN_FILES and not any(f == name or f.endswith("/" + name) for f in repository_files()):
            bad.add(match[1])
    return bad


PROSE = [*DOCS, "dataset_card.md", *(str(p.relative_to(ROOT)) for p in package_sources())]


@pytest.fixture(scope="module")
def build_json_keys() -> set[str]:
    """The top-level keys of medbanana-build.json, as `builder.card.build_info` writes them (`stats.refused` is one of
    its key paths, not a module's name)."""
    tree = ast.parse((ROOT / "builder" / "card.py").read_text(encoding="utf-8"))
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_info")
    returned = next(n.value for n in ast.walk(function) if isinstance(n, ast.Return))
    assert isinstance(returned, ast.Dict), "build_info no longer returns a dict display: read its keys another way"
    keys = {key.value for key in returned.keys if isinstance(key, ast.Constant)}
    assert {"stats", "sources", "configs"} <= keys
    return keys


def test_the_name_patterns_find_what_the_prose_names():
    runs = prose(ROOT / "generation" / "rundir" / "runs.py")
    assert "generation.rundir.layout" in {m[1] for m in STAGE_DOTTED.finditer(runs)}
    assert "layout.inside" in {m[1] for m in BACKTICKED.finditer("written only inside --out (`layout.inside`, links")}
    text = "`generation.layout`, generation.lock.LockHeld, `run_json.nothing`, `RunStore.nothing`, (pipeline.py)"
    assert unresolved_names(text, set()) == {"generation.layout", "generation.lock.LockHeld", "run_json.nothing",
                                             "RunStore.nothing"}
    assert unresolved_files(text + " rundir/lock.py, medbanana/demo.py, schema.py") == {"pipeline.py"}
    fine = ("`generation.rundir.lock.LockHeld`, `records.Verdict`, `RunStore.journal_attempt`, `layout.inside()`, "
            "`medbanana.generation.dataset.features.CONFIG_FEATURES`, `RunOptions.workers`, `review.sqlite`, `trl.DPOTrainer`, "
            "`medbanana.dpo.RECIPE`, `ds.num_rows`")
    assert unresolved_names(fine, set()) == set()
    assert unknown_words("the Structs of `run_schema`; `run_json` reads `all_conversations.json` into "
                         "`success_round`, as `read_tasks()` and `snapshot_download` do") == {"run_schema"}


@pytest.mark.parametrize("doc", PROSE)
def test_every_module_and_name_the_prose_names_exists(doc, build_json_keys):
    text = prose(ROOT / doc)
    stale = sorted(unresolved_names(text, build_json_keys) | unresolved_files(text))
    assert not stale, f"{doc} names modules, names or files that do not exist (moved or renamed?): {stale}"
    unknown = sorted(unknown_words(text))
    assert not unknown, f"{doc} names {unknown}, which no code of the package knows (moved or renamed? a " \
                        "library's name: add it to LIBRARY_WORDS)"
