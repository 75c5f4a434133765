"""`generate --batch` with --c2pa-cert/--c2pa-key signs every image it writes as the local runner does: each one
verifies, carries one manifest of its own (its task and round), and says what the local runner's copy says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("c2pa")
pytest.importorskip("cryptography")

from fake_runs import mimic_sources, use_fake_gemini  # noqa: E402
from signed_runs import active_assertion, make_keys, manifest_store, reader_state, run_images  # noqa: E402
from medbanana.cli import main  # noqa: E402
from medbanana.generation.records import decode_rgb  # noqa: E402
from medbanana.generation.rundir import layout  # noqa: E402
from medbanana.generation.rundir.signing import ASSERTION_LABEL  # noqa: E402
from medbanana.generation.rundir.store import read_journal  # noqa: E402

KEY = "batch-signing-key-81c2"


def _round_images(run_dir: Path) -> dict[str, tuple[str, int]]:
    """Image path -> (task uid, round) of every journalled round with an image."""
    return {e["round"]["image"]: (e["uid"], e["round"]["round"]) for e in read_journal(run_dir / layout.JOURNAL)
            if e["type"] == "round" and e["round"].get("image")}


@pytest.mark.slow
def test_a_batch_run_signs_every_image_as_the_local_runner_does(echo_gemini, tmp_path, monkeypatch, capsys):
    use_fake_gemini(monkeypatch, echo_gemini, KEY)
    echo_gemini.reset()
    sources = mimic_sources(tmp_path / "sources", "MIMIC_signed", size=64)
    keys = make_keys(tmp_path / "keys")
    common = ["generate", "--sources", str(sources), "--backend", "gemini", "-q", "--max-rounds", "2", "--max-attempts", "3",
              "--c2pa-cert", str(keys.chain), "--c2pa-key", str(keys.key)]
    assert main([*common, "--out", str(tmp_path / "batch"), "--batch", "--poll-interval", "0.02"]) == 0
    assert echo_gemini.batches.created() and all(c.path.startswith("batches/") for c in echo_gemini.calls)
    assert main([*common, "--out", str(tmp_path / "local")]) == 0
    batch, local = run_images(tmp_path / "batch"), run_images(tmp_path / "local")
    assert batch.keys() == local.keys() and {"-failed/" in rel for rel in batch} == {True, False}  # both kinds
    rounds = _round_images(tmp_path / "batch")
    run_id = json.loads((tmp_path / "batch" / layout.RUN_CONFIG).read_text())["run_id"]
    ca = keys.ca.read_bytes()
    for rel, data in batch.items():
        assert reader_state(data, ca) == ("Trusted", set()), rel
        assert len(manifest_store(data)["manifests"]) == 1, rel
        made = active_assertion(data, ASSERTION_LABEL)
        assert (made["task_uid"], made["round"]) == rounds[rel] and made["run_id"] == run_id
        theirs = active_assertion(local[rel], ASSERTION_LABEL)
        assert {k: v for k, v in made.items() if k != "run_id"} == {k: v for k, v in theirs.items() if k != "run_id"}
        assert np.array_equal(decode_rgb(data), decode_rgb(local[rel]))
    capsys.readouterr()
    assert main(["verify", "--run", str(tmp_path / "batch"), "--trust", str(keys.ca)]) == 0
    assert f"{len(batch)} valid, 0 untrusted, 0 invalid, 0 missing" in capsys.readouterr().out
