"""What each install costs on disk: the core (`pip install medbanana`) and each extra on top of it.

    python bench/extras_sizes.py                 # reads pyproject.toml, measures the environment it runs in

Measured, not guessed: for the core dependencies and for each extra of pyproject.toml, the closure of requirements
(markers evaluated for this machine, extras of dependencies followed) is resolved over the distributions installed in
the running environment, and the files each one's RECORD lists are summed as they lie on disk. An extra's figure is
what it adds to the core. Run it in an environment where every extra is installed (the development install): a
requirement that is not installed is listed as missing, and its size is not counted. The figures are for the
versions installed and this platform (on Linux, PyPI's torch wheel pulls the CUDA libraries).
"""

from __future__ import annotations

import argparse
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def installed() -> dict[str, metadata.Distribution]:
    return {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}


def dist_bytes(dist: metadata.Distribution) -> int:
    total = 0
    for file in dist.files or ():
        path = Path(dist.locate_file(file))
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def closure(requirements: list[str], dists: dict, missing: set[str]) -> set[str]:
    """Names of every installed distribution the requirements pull in (each requirement's extras followed)."""
    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name not in dists:
            missing.add(name)
            continue
        wanted = [("", name)] + [(e, name) for e in sorted(req.extras)]
        for extra_name, _ in wanted:
            key = f"{name}[{extra_name}]"
            if key in seen:
                continue
            seen.add(key)
            for sub in dists[name].requires or ():
                todo.append((Requirement(sub), extra_name))
    return {key.split("[")[0] for key in seen}


def line(names: set[str], sizes: dict[str, int]) -> str:
    heaviest = sorted(names, key=sizes.__getitem__, reverse=True)[:3]
    return (f"{sum(sizes[n] for n in names) / 1e6:,.0f} MB in {len(names)} distribution(s) (largest: "
            f"{', '.join(f'{n} {sizes[n] / 1e6:,.0f} MB' for n in heaviest)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    ap.add_argument("--together", default="dev,train,eval",
                    help="extras installed together, measured once (default: the development install's)")
    args = ap.parse_args()
    project = tomllib.loads(args.pyproject.read_text())["project"]
    dists = installed()
    missing: set[str] = set()
    core = closure(project["dependencies"], dists, missing)
    sizes = {name: dist_bytes(dists[name]) for name in dists}
    print(f"core: {line(core, sizes)}")
    extras = project["optional-dependencies"]
    for extra, requirements in extras.items():
        print(f"[{extra}]: +{line(closure(requirements, dists, missing) - core, sizes)}")
    together = [r for extra in args.together.split(",") for r in extras[extra]]
    print(f"[{args.together}] together: +{line(closure(together, dists, missing) - core, sizes)}")
    if missing:
        print(f"not installed here, not counted: {', '.join(sorted(missing))}")


if __name__ == "__main__":
    main()
