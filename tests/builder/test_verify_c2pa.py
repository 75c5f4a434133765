"""`medbanana verify --c2pa` over a dataset built from a signed run, and over the run itself; the card's paragraph."""

import shutil

import pytest

pytest.importorskip("c2pa")
pytest.importorskip("cryptography")

import pyarrow.parquet as pq  # noqa: E402

from signed_runs import make_keys, one_scan_byte_changed, signed_run, without_manifest  # noqa: E402
from medbanana.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from medbanana.generation.backends.simulator.phantoms import write_demo_sources

    root = tmp_path_factory.mktemp("c2pa-build")
    keys = make_keys(root / "keys")
    write_demo_sources(root / "sources", n_normal=1, n_diseased=1, size=256)
    assert signed_run(root / "sources", root / "run", keys, "--limit", "8") == 0
    assert main(["build", str(root / "run"), "--out", str(root / "ds"), "-q"]) == 0
    return root, keys


def test_verify_counts_every_generated_image_valid_and_the_card_names_the_certificate(built, capsys):
    root, keys = built
    assert main(["verify", str(root / "ds"), "--c2pa", "--trust", str(keys.ca), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "C2PA:" in x)
    assert " 0 untrusted, 0 invalid, 0 missing" in line and not line.split("checked")[0].endswith(" 0 image(s) ")
    card = (root / "ds" / "README.md").read_text()
    assert keys.fingerprint in card and "Signed Content Credentials (C2PA)" in card
    assert main(["verify", "--run", str(root / "run"), "--trust", str(keys.ca)]) == 0


def test_verify_names_untrusted_tampered_and_stripped_rows(built, tmp_path, capsys):
    root, keys = built
    other = make_keys(tmp_path / "other")
    assert main(["verify", str(root / "ds"), "--trust", str(other.ca), "--workers", "1"]) == 1
    assert "0 valid" in capsys.readouterr().out
    # a copy of the sft shard with row 0's image changed in one byte of its scan and row 1's manifest stripped
    ds = tmp_path / "ds"
    (ds / "sft").mkdir(parents=True)
    shard = next((root / "ds" / "sft").glob("*.parquet"))
    table = pq.read_table(shard)
    images = table.column("edited_image").to_pylist()
    assert len(images) >= 2
    images[0] = {**images[0], "bytes": one_scan_byte_changed(images[0]["bytes"])}
    images[1] = {**images[1], "bytes": without_manifest(images[1]["bytes"])}
    index = table.schema.get_field_index("edited_image")
    tampered = table.set_column(index, table.schema.field(index), [images])
    pq.write_table(tampered, ds / "sft" / shard.name)
    assert main(["verify", str(ds), "--c2pa", "--trust", str(keys.ca)]) == 1  # no SHA256SUMS: said, then checked
    out = capsys.readouterr().out
    assert "1 invalid, 1 missing" in out and f"sft/{shard.name} row 0 edited_image" in out
    out = _verify_dataset_c2pa(ds, keys.ca)
    assert out.counts["invalid"] == 1 and out.counts["missing"] == 1
    assert out.rows["invalid"] == [f"sft/{shard.name} row 0 edited_image"]
    assert out.rows["missing"] == [f"sft/{shard.name} row 1 edited_image"]
    assert "assertion.dataHash.mismatch" in out.failures


def _verify_dataset_c2pa(folder, ca):
    from medbanana.builder.c2pa_check import dataset_images, verify_c2pa

    return verify_c2pa(dataset_images(folder), trust=ca, workers=1)


def test_a_stripped_image_in_a_run_is_missing(built, tmp_path, capsys):
    root, keys = built
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    image = next(p for p in run.rglob("*.jpeg") if "-failed" not in p.parent.parent.name)
    image.write_bytes(without_manifest(image.read_bytes()))
    assert main(["verify", "--run", str(run), "--trust", str(keys.ca)]) == 1
    out = capsys.readouterr().out
    assert "1 missing" in out and image.relative_to(run).as_posix() in out
