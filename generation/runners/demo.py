"""The offline demo: synthetic sources for all three modalities, a simulator run over them, and the dataset built
from it (no download, no key)."""

from __future__ import annotations

from pathlib import Path

from ..files import atomic_write_json
from ..rundir import layout
from .generate import generate
from .local import RunOptions, RunSummary


def run_demo(out: Path, *, n_normal: int = 2, n_diseased: int = 1, concurrency: int = 2, seed: int = 0,
             size: int = 1024, quiet: bool = False, build_dataset: bool = True) -> RunSummary:
    """Synthesise sources for all three modalities (no download, no key), generate with the simulator, and build
    the Hugging Face dataset folder OUT/dataset (sources attached: they are synthetic, so redistributable)."""
    from ..backends.simulator.phantoms import write_demo_sources

    out = Path(out)
    sources, run_dir = out / "sources", out / "run"
    manifest = sources / layout.SOURCES_MANIFEST
    if not manifest.exists():  # a rerun resumes on the same sources
        provenance = write_demo_sources(sources, n_normal=n_normal, n_diseased=n_diseased, size=size, seed=seed)
        atomic_write_json(manifest, provenance)
    summary = generate(sources, run_dir, backend="simulator",
                       options=RunOptions(concurrency=concurrency, seed=seed, quiet=quiet),
                       extra_config={"demo": {"n_normal": n_normal, "n_diseased": n_diseased, "size": size}})
    run_manifest = run_dir / layout.SOURCES_MANIFEST
    if not run_manifest.exists():
        run_manifest.write_bytes(manifest.read_bytes())
    if build_dataset:
        from ...builder.build import build

        summary.dataset = build([run_dir], out / "dataset", source_images=sources, quiet=quiet)
        summary.dataset_dir = out / "dataset"
    return summary
