"""Setup shared by the tests that run medbanana's API backends against the fake servers (generation/testing/): a
small source tree, the environment that points the Gemini client at a fake, a synthetic chest radiograph to edit,
and back-off sleeps recorded instead of slept (conftest.py's `sleeps` and `echo_gemini` fixtures use these)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conftest import write_jpeg
from medbanana.generation.records import SourceImage, encode_jpeg


def mimic_sources(root: Path, dataset: str, *, disease: str = "Pneumothorax", per_class: int = 2, size: int = 128,
                  disease_seed: int = 10) -> Path:
    """`root` in the input layout: one dataset folder with `per_class` normal JPEGs (n0, n1, ...; random pixels of
    seeds 0, 1, ...) and `per_class` of `disease` (p0, p1, ...; seeds disease_seed, disease_seed + 1, ...)."""
    for i in range(per_class):
        write_jpeg(root / dataset / "normal" / f"n{i}.jpeg", i, size=size)
        write_jpeg(root / dataset / disease / f"p{i}.jpeg", disease_seed + i, size=size)
    return root


def use_fake_gemini(monkeypatch, fake, key: str) -> None:
    """Point this process's Gemini client at the fake server `fake`, with `key` as the API key."""
    monkeypatch.setenv("GEMINI_API_KEY", key)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", fake.base_url)


def chest_source(folder: Path, size: int = 256) -> SourceImage:
    """A synthetic chest radiograph, `size` pixels square (two dark lung fields on a bright body, noise of seed 0),
    written to folder/patient01.jpeg."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    middle, inner, outer, top, bottom = (value * size // 256 for value in (128, 25, 105, 30, 220))
    lungs = ((np.abs(xx - middle) > inner) & (np.abs(xx - middle) < outer) & (yy > top) & (yy < bottom)).astype(float)
    gray = np.clip(200 - 120 * lungs + rng.normal(0, 6, (size, size)), 0, 255)
    path = folder / "patient01.jpeg"
    path.write_bytes(encode_jpeg(np.repeat(gray[..., None], 3, axis=2)))
    return SourceImage(path)


class RecordedSleeps(list):
    """A backend's `sleep` that records the seconds asked for instead of sleeping them (it is their list), so that
    back-off and Retry-After are checked without waiting."""

    async def __call__(self, seconds: float) -> None:
        self.append(seconds)
