"""C2PA signing of every image a run writes: keys made here, runs made through the CLI, read back with c2pa.Reader."""

import base64
import hashlib
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("c2pa")
pytest.importorskip("cryptography")

import numpy as np  # noqa: E402

from signed_runs import (active_assertion, make_keys, manifest_store, one_scan_byte_changed, reader_state,  # noqa: E402
                         run_images, signed_run, without_manifest)
from medbanana.cli import main  # noqa: E402
from medbanana.generation.rundir import layout  # noqa: E402
from medbanana.generation.records import decode_rgb  # noqa: E402
from medbanana.generation.rundir.provenance import PNG_SIGNATURE, png_chunks, read_mark  # noqa: E402
from medbanana.generation.rundir.signing import ASSERTION_LABEL, SigningCredentials, SigningError  # noqa: E402
from medbanana.generation.rundir.store import read_journal  # noqa: E402
from kills import kill_repeatedly  # noqa: E402
from paths import ROOT  # noqa: E402


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def signed(tmp_path_factory, keys):
    """A signed simulator run over the demo's phantoms, with accepted and rejected attempts among its images."""
    from medbanana.generation.backends.simulator.phantoms import write_demo_sources

    root = tmp_path_factory.mktemp("signed")
    sources = root / "sources"
    write_demo_sources(sources, n_normal=1, n_diseased=1, size=256)
    assert signed_run(sources, root / "run", keys, "--limit", "8") == 0
    return sources, root / "run"


def test_keys_init_writes_a_ca_a_chain_and_a_private_key_only_the_owner_reads(tmp_path, capsys):
    assert main(["keys", "init", str(tmp_path / "k")]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "k" / "signer-chain.pem").read_bytes().count(b"BEGIN CERTIFICATE") == 2
    assert (tmp_path / "k" / "signer.key").stat().st_mode & 0o077 == 0
    assert b"PRIVATE KEY" not in (tmp_path / "k" / "ca.pem").read_bytes()
    assert "PRIVATE KEY" not in printed and "signing certificate SHA-256" in printed
    assert main(["keys", "init", str(tmp_path / "k")]) == 2  # never overwrites a key without --force


@pytest.mark.slow
def test_every_image_is_signed_valid_and_trusted_with_the_ca(signed, keys):
    sources, run = signed
    images = run_images(run)
    assert any("-failed/" in rel for rel in images) and any("-failed/" not in rel for rel in images)
    ca = keys.ca.read_bytes()
    config = json.loads((run / layout.RUN_CONFIG).read_text())
    assert config["c2pa"]["certificate_sha256"] == keys.fingerprint
    for rel, data in images.items():
        assert reader_state(data, ca) == ("Trusted", set()), rel
        state, failures = reader_state(data)  # no anchors: the signature holds, the signer is unknown
        assert state == "Valid" and failures == {"signingCredential.untrusted"}
        assert read_mark(data).run_id == config["run_id"]  # the XMP mark stays
    rounds = [e["round"] for e in read_journal(run / layout.JOURNAL) if e["type"] == "round"]
    entry = next(e for e in read_journal(run / layout.JOURNAL) if e["type"] == "round" and e["round"]["image"])
    made = active_assertion(images[entry["round"]["image"]], ASSERTION_LABEL)
    assert made["run_id"] == config["run_id"] and made["task_uid"] == entry["uid"]
    assert made["round"] == entry["round"]["round"] and rounds
    assert made["instruction_sha256"] == hashlib.sha256(entry["round"]["instruction"].encode()).hexdigest()
    source_hashes = {hashlib.sha256(p.read_bytes()).hexdigest() for p in sources.rglob("*.jpeg")}
    assert made["source_sha256"] in source_hashes


@pytest.mark.slow
def test_one_changed_pixel_is_invalid_a_stripped_manifest_missing_another_ca_untrusted(signed, keys, tmp_path):
    _, run = signed
    data = next(iter(run_images(run).values()))
    state, failures = reader_state(one_scan_byte_changed(data), keys.ca.read_bytes())
    assert state == "Invalid" and "assertion.dataHash.mismatch" in failures
    assert reader_state(without_manifest(data), keys.ca.read_bytes())[0] == "missing"
    other = make_keys(tmp_path / "other")
    assert reader_state(data, other.ca.read_bytes()) == ("Valid", {"signingCredential.untrusted"})


@pytest.mark.slow
def test_no_key_material_in_the_run_or_the_dataset(signed, keys, tmp_path):
    _, run = signed
    assert main(["build", str(run), "--out", str(tmp_path / "ds"), "-q"]) == 0
    key_pem = keys.key.read_bytes()
    body = b"".join(line for line in key_pem.splitlines() if not line.startswith(b"-----"))
    from cryptography.hazmat.primitives import serialization

    scalar = serialization.load_pem_private_key(key_pem, None).private_numbers().private_value.to_bytes(32, "big")
    # the secret is the scalar; the PEM's first 48 characters are the same for every P-256 key, its tail holds
    # the public key (which the certificate in every manifest carries), so the needles are the scalar's forms
    needles = [b"PRIVATE KEY", body[48:88], scalar, scalar.hex().encode(), base64.b64encode(scalar)]
    for folder in (run, tmp_path / "ds"):
        for path in folder.rglob("*"):
            if path.is_file():
                content = path.read_bytes()
                assert not any(n in content for n in needles), path
                assert str(keys.key).encode() not in content, path  # not even where the key lives


@pytest.mark.slow
def test_resuming_with_another_certificate_or_none_is_refused(signed, keys, tmp_path, capsys):
    sources, run = signed
    other = make_keys(tmp_path / "other")
    assert signed_run(sources, run, other, "--limit", "8") == 2
    assert keys.fingerprint in capsys.readouterr().err
    assert main(["generate", "--backend", "simulator", "--sources", str(sources), "--out", str(run), "-q",
                 "--max-rounds", "3", "--limit", "8"]) == 2
    err = capsys.readouterr().err
    assert "resume it with the same --c2pa-cert" in err and "PRIVATE" not in err
    with pytest.raises(SigningError, match="both"):
        SigningCredentials.from_options(keys.chain, None, environ={})
    assert SigningCredentials.from_options(None, None, environ={"MEDBANANA_C2PA_CERT": str(keys.chain),
                                                                "MEDBANANA_C2PA_KEY": str(keys.key)}).key == keys.key


def test_a_key_that_is_not_the_certificates_is_refused_without_showing_it(keys, tmp_path, tiny_sources, capsys):
    other = make_keys(tmp_path / "other")
    code = main(["generate", "--backend", "simulator", "--sources", str(tiny_sources), "--out", str(tmp_path / "r"),
                 "-q", "--limit", "1", "--c2pa-cert", str(keys.chain), "--c2pa-key", str(other.key)])
    err = capsys.readouterr().err
    assert code == 2 and "does not belong to the certificate" in err and "PRIVATE" not in err


@pytest.mark.slow
def test_workers_sign_in_the_writing_process(keys, tmp_path, tiny_sources):
    assert signed_run(tiny_sources, tmp_path / "run", keys, "--limit", "4", "--workers", "2") == 0
    images = run_images(tmp_path / "run")
    assert images and all(reader_state(d, keys.ca.read_bytes())[0] == "Trusted" for d in images.values())


@pytest.mark.slow
def test_png_images_are_signed_and_verify_with_their_pixels_untouched(keys, tmp_path, tiny_sources, capsys):
    png = ["--editor", "signed_runs:PngEditor", "--limit", "4"]  # an editor backend of one's own that answers PNG
    assert signed_run(tiny_sources, tmp_path / "signed", keys, *png) == 0
    assert main(["generate", "--backend", "simulator", "--sources", str(tiny_sources), "--out",
                 str(tmp_path / "plain"), "-q", "--max-rounds", "3", *png]) == 0
    signed, plain = run_images(tmp_path / "signed"), run_images(tmp_path / "plain")
    assert signed and signed.keys() == plain.keys()
    ca = keys.ca.read_bytes()
    for rel, data in signed.items():
        assert data.startswith(PNG_SIGNATURE) and data != plain[rel]
        assert reader_state(data, ca) == ("Trusted", set()), rel
        assert len(manifest_store(data)["manifests"]) == 1 and read_mark(data) is not None
        # signing adds chunks; the compressed pixels (IDAT) are the unsigned run's, byte for byte
        idat = [[d[s:e] for kind, s, e in png_chunks(d) if kind == b"IDAT"] for d in (data, plain[rel])]
        assert idat[0] == idat[1] and np.array_equal(decode_rgb(data), decode_rgb(plain[rel]))
    capsys.readouterr()
    assert main(["verify", "--run", str(tmp_path / "signed"), "--trust", str(keys.ca)]) == 0
    assert f"{len(signed)} valid, 0 untrusted, 0 invalid, 0 missing" in capsys.readouterr().out


KILL_CLI = [sys.executable, "-m", "medbanana", "generate", "--backend", "simulator", "-q", "--max-rounds", "3",
            "--concurrency", "2"]


@pytest.mark.slow
def test_a_run_killed_and_resumed_is_still_fully_signed(keys, tmp_path, tiny_sources):
    out = tmp_path / "run"
    cmd = KILL_CLI + ["--sources", str(tiny_sources), "--out", str(out)]
    env = {**os.environ, "MEDBANANA_C2PA_CERT": str(keys.chain), "MEDBANANA_C2PA_KEY": str(keys.key),
           "PYTHONPATH": str(ROOT.parent)}
    kills = kill_repeatedly(lambda: subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL),
                            out / layout.JOURNAL, tries=4, deadline=60)  # kill -9 a few journal lines further each time
    assert kills >= 2
    assert subprocess.run(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL).returncode == 0
    images = run_images(out)
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*.jpeg") if "medbanana-orphans" not in str(p)}
    assert images and on_disk == set(images)
    ca = keys.ca.read_bytes()
    for rel, data in images.items():
        assert reader_state(data, ca) == ("Trusted", set()), rel
