"""Hostile input to `verify`, `merge`, the dataset card and the XMP mark, built for real in each test (issue 13).

`verify` is compared with GNU `sha256sum --strict -c` on the same files: it accepts every form sha256sum accepts,
and refuses what leads outside the folder or repeats an entry, which sha256sum accepts.
"""

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree

import pytest
from conftest import write_jpeg
from trees import snapshot
from PIL import Image

from medbanana.generation.dataset import manifest
from medbanana.builder.build import build
from medbanana.generation.dataset.manifest import MANIFEST, ManifestError, verify_manifest, write_manifest
from medbanana.cli import main
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.provenance import mark_synthetic, read_mark, xmp_of, xmp_text
from medbanana.generation.records import Attempt, EditedImage, Instruction, Task
from medbanana.generation.rundir.store import RunStore

SHA256SUM = shutil.which("sha256sum")
needs_sha256sum = pytest.mark.skipif(SHA256SUM is None, reason="GNU sha256sum not installed")


def tree(root: Path) -> set[str]:
    """Every path under `root`, symlinks not followed: what a command left on disk."""
    found = set()
    for folder, dirs, files in os.walk(root):
        found.update(os.path.join(folder, name) for name in dirs + files)
    return found


def sha256sum_rc(folder: Path, *options: str) -> int:
    done = subprocess.run([SHA256SUM, *options, "-c", MANIFEST], cwd=folder, capture_output=True, check=False)
    return done.returncode


def sha256sum_accepts(folder: Path) -> bool:
    return sha256sum_rc(folder, "--strict") == 0


# ---------------------------------------------------------------- verify

FILES = {"a.txt": b"a\n", "b c.txt": b"space", "sub/d.bin": bytes(range(256)), "back\\slash.txt": b"b",
         "new\nline.txt": b"n", "cr\rname.txt": b"r"}


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "ds"
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (tmp_path / "secret.txt").write_bytes(b"private file of the machine")
    return root


def escaped_lines(listing: bytes) -> int:
    return sum(line.startswith(b"\\") for line in listing.split(b"\n"))


def _escaped(name: str) -> str:
    return name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


# name -> line for (digest, name, backslash or ""): the forms sha256sum -c reads (coreutils digest.c, split_3)
FORMS = {
    "text": lambda d, n, b: f"{b}{d}  {n}",
    "binary": lambda d, n, b: f"{b}{d} *{n}",
    "uppercase": lambda d, n, b: f"{b}{d.upper()}  {n}",
    "indented": lambda d, n, b: f" \t{b}{d}  {n}",
    "tagged": lambda d, n, b: f"{b}SHA256 ({n}) = {d}",
    "openssl tag": lambda d, n, b: f"{b}SHA256({n})= {d.upper()}",
    "one blank": lambda d, n, b: f"{b}{d} {n}",
    "tab": lambda d, n, b: f"{b}{d}\t{n}",
    "dot slash": lambda d, n, b: f"{b}{d}  ./{n}",
}


def write_form(folder: Path, form: str, end: str = "\n", comments: bool = False) -> None:
    lines = ["# written by hand", ""] if comments else []
    for name, data in FILES.items():
        b = "\\" if any(c in name for c in "\\\n\r") else ""
        lines.append(FORMS[form](hashlib.sha256(data).hexdigest(), _escaped(name), b))
    (folder / MANIFEST).write_bytes((end.join(lines) + end).encode())


@needs_sha256sum
@pytest.mark.parametrize("form", list(FORMS))
def test_verify_accepts_each_form_sha256sum_accepts(folder, form):
    write_form(folder, form)
    assert sha256sum_accepts(folder)
    report = verify_manifest(folder)
    assert report.ok and report.checked == len(FILES), report.describe()


@needs_sha256sum
@pytest.mark.parametrize("tool_args", [[], ["--tag"], ["-b"]], ids=["plain", "tag", "binary"])
def test_verify_accepts_what_sha256sum_itself_writes(folder, tool_args):
    names = sorted(FILES)
    listing = subprocess.run([SHA256SUM, *tool_args, *names], cwd=folder, capture_output=True, check=True).stdout
    assert escaped_lines(listing) == 3  # the escaped-name form is exercised
    (folder / MANIFEST).write_bytes(listing)
    assert sha256sum_accepts(folder) and verify_manifest(folder).ok


@needs_sha256sum
def test_write_manifest_escapes_names_as_sha256sum_does_and_crlf_and_comments_read(folder):
    write_manifest(folder)
    assert escaped_lines((folder / MANIFEST).read_bytes()) == 3
    assert sha256sum_accepts(folder) and verify_manifest(folder).checked == len(FILES)
    write_form(folder, "binary", end="\r\n", comments=True)
    assert sha256sum_accepts(folder) and verify_manifest(folder).ok


@needs_sha256sum
def test_verify_and_sha256sum_both_fail_a_changed_file(folder):
    write_form(folder, "uppercase")
    (folder / "sub/d.bin").write_bytes(b"changed")
    assert not sha256sum_accepts(folder)
    assert verify_manifest(folder).changed == ["sub/d.bin"]


@needs_sha256sum
@pytest.mark.parametrize("bad_line", [
    "{d}\ta.txt",  # md5 -r style after a standard line: GNU refuses to mix them
    "\\{d}  bad\\qescape",  # only \\, \n and \r may be escaped
    "\\{d}  trailing\\",  # an escaped name may not end in a lone backslash
    "{short}  a.txt",
    "{d}  ",
    "SHA256 (a.txt) = {d} ",  # nothing may follow the tagged digest
    "SHA256  (a.txt) = {d}",
    "SHA256 (a.txt = {d}",
    "  # indented comment",
])
def test_misformatted_lines_are_refused_by_both_with_the_line_named(folder, bad_line):
    digest = hashlib.sha256(FILES["a.txt"]).hexdigest()
    (folder / MANIFEST).write_text(f"{digest}  a.txt\n{bad_line.format(d=digest, short=digest[:-1])}\n")
    assert not sha256sum_accepts(folder)
    with pytest.raises(ManifestError, match=rf"{MANIFEST}:2: not a `sha256sum` line"):
        verify_manifest(folder)


def outside_entries(folder: Path) -> dict[str, str]:
    """Manifest names leading outside `folder`, each with the right digest of what it reaches."""
    secret = folder.parent / "secret.txt"
    (folder / "link.txt").symlink_to(secret)
    (folder / "sub" / "dirlink").symlink_to(folder.parent, target_is_directory=True)
    return {"../secret.txt": "outside", str(secret): "absolute", "link.txt": "through a symlink",
            "sub/../../secret.txt": "outside", "sub/dirlink/secret.txt": "through a symlink",
            "../../../../etc/hostname": "outside", "/etc/hostname": "absolute"}


@needs_sha256sum
def test_verify_refuses_paths_outside_the_folder_before_hashing_anything(folder, monkeypatch, capsys):
    entries = outside_entries(folder)
    secret_digest = manifest.sha256_file(folder.parent / "secret.txt")
    first = f"{manifest.sha256_file(folder / 'a.txt')}  a.txt\n"
    hashed, real = [], manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p: hashed.append(p) or real(p))
    for name, reason in entries.items():
        digest = secret_digest if "secret" in name or name == "link.txt" else "0" * 64
        (folder / MANIFEST).write_text(f"{first}{digest}  {name}\n")
        if digest == secret_digest:
            assert sha256sum_rc(folder) == 0, name  # sha256sum hashes the private file and says OK; verify must not
        with pytest.raises(ManifestError) as err:
            verify_manifest(folder)
        assert f"{MANIFEST}:2" in str(err.value) and name in str(err.value) and reason in str(err.value), name
        assert hashed == [], name
        assert main(["verify", str(folder)]) == 1
        assert f"{MANIFEST}:2" in capsys.readouterr().err


def test_verify_refuses_a_manifest_that_is_a_symlink_out(folder):
    (folder / MANIFEST).symlink_to(folder.parent / "secret.txt")
    with pytest.raises(layout.UnsafePath, match="symlink"):
        verify_manifest(folder)


@needs_sha256sum
@pytest.mark.parametrize("second", ["a.txt", "./a.txt", ".//a.txt", "SHA256 (a.txt) = {d}"])
def test_verify_refuses_duplicate_entries_naming_both_lines(folder, second):
    digest = manifest.sha256_file(folder / "a.txt")
    # a wrong first entry, then a right one: with "last entry wins" the file would pass
    line = second.format(d=digest) if "{d}" in second else f"{digest}  {second}"
    (folder / MANIFEST).write_text(f"{'0' * 64}  a.txt\n{line}\n")
    assert sha256sum_rc(folder) == 1  # sha256sum checks both lines; the wrong one fails it
    with pytest.raises(ManifestError, match=rf"{MANIFEST}:2: .*listed again \(first on line 1\)"):
        verify_manifest(folder)


# ---------------------------------------------------------------- merge

CONFIG = {"format_version": 1, "backends": {"writer": "simulator", "editor": "simulator", "judge": "simulator"},
          "max_rounds": 3, "accept": "judge", "seed": 0}


def task_record(stem: str, image: str, dataset: str = "DS", final: str | None = None) -> dict:
    key = f"{stem}-Pneumothorax"
    return {"image": f"{stem}.jpeg", "disease": "Pneumothorax", "status": "success",
            "rounds": [{"round": 1, "instruction": "add it", "accepted": True, "image": image}],
            "final_prompt": "add it", "final_image_path": "", "key": key, "uid": f"{dataset}/add/{key}",
            "dataset": dataset, "modality": "chest_xray", "task": "add", "source_id": stem,
            "final_image": final if final is not None else image}


def make_shard(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / layout.RUN_CONFIG).write_text(json.dumps({**CONFIG, "run_id": run_dir.name}))
    (run_dir / layout.JOURNAL).write_text("".join(
        json.dumps({"type": "task", "uid": record["uid"], "record": record}) + "\n" for record in records))
    return run_dir


def legit(run_dir: Path, stem: str) -> dict:
    """A finished task whose accepted image is in the shard."""
    rel = layout.accepted_image_relpath("DS", "add", stem, "Pneumothorax")
    write_jpeg(run_dir / rel, len(stem))
    return task_record(stem, rel)


def test_merge_of_honest_shards_still_works(tmp_path):
    shards = [make_shard(tmp_path / f"s{i}", [legit(tmp_path / f"s{i}", f"n{i}")]) for i in range(2)]
    out = tmp_path / "merged"
    assert main(["merge", *map(str, shards), "--out", str(out)]) == 0
    for i in range(2):
        rel = layout.accepted_image_relpath("DS", "add", f"n{i}", "Pneumothorax")
        assert (out / rel).read_bytes() == (shards[i] / rel).read_bytes()
    progress = json.loads((out / "DS-edit" / layout.PROGRESS).read_text())
    assert set(progress) == {"n0-Pneumothorax", "n1-Pneumothorax"}


HOSTILE = {  # case -> (record fields, the path the error must name)
    "image ../../ out": ({"image": "../../payload/x.txt"}, "../../payload/x.txt"),
    "absolute image": ({"image": "{abs}"}, "{abs}"),
    "image symlinked out": ({"image": "DS-edit/Pneumothorax/link.jpeg"}, "DS-edit/Pneumothorax/link.jpeg"),
    "final_image ../": ({"final_image": "../../payload/y.txt"}, "../../payload/y.txt"),
    "dataset ../": ({"dataset": "../../evil"}, "../../evil"),
    "absolute dataset": ({"dataset": "{abs_dir}"}, "{abs_dir}"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_merge_refuses_journal_paths_leading_out_and_writes_nothing(tmp_path, case, capsys):
    # shard and --out at different depths, so `../../x` names another file from each: a read and a new file
    payload, secret = tmp_path / "shards" / "payload", tmp_path / "secret.txt"
    payload.mkdir(parents=True)
    (payload / "x.txt").write_text("payload")
    secret.write_text("private")
    shard = tmp_path / "shards" / "s1" / "run"
    subst = {"abs": str(payload / "x.txt"), "abs_dir": str(tmp_path / "evil")}
    fields, named = HOSTILE[case]
    fields, named = {k: v.format(**subst) for k, v in fields.items()}, named.format(**subst)
    first, hostile = legit(shard, "n0"), legit(shard, "n1")
    (shard / "DS-edit" / "Pneumothorax" / "link.jpeg").symlink_to(secret)
    if "image" in fields:
        hostile["rounds"][0]["image"] = hostile["final_image"] = fields.pop("image")
    hostile.update(fields)
    make_shard(shard, [first, hostile])  # the honest task first: nothing of it may be written either
    out = tmp_path / "merged" / "out"
    before = tree(tmp_path)
    assert main(["merge", str(shard), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"shard {shard}, {layout.JOURNAL} line 2" in err and named in err, err
    assert tree(tmp_path) == before  # nothing outside --out, and --out itself not started
    assert not out.exists()


def _task_image(shard: Path, record: dict) -> Path:
    return shard / record["rounds"][0]["image"]


def _replace_image(shard: Path, record: dict, make) -> None:
    """The file at the record's own image path becomes what `make(path)` leaves there."""
    path = _task_image(shard, record)
    path.unlink()
    make(path)


def _set(field: str, value):
    def change(shard, record, other):
        record[field] = value
    return change


def _set_image(value: str):
    def change(shard, record, other):
        record["rounds"][0]["image"] = record["final_image"] = value(other) if callable(value) else value
    return change


HOSTILE_RECORDS = {  # case -> (how the second record of the shard is spoiled, the field the refusal names)
    "no key": (lambda shard, record, other: record.pop("key"), "record.key"),
    "image '.'": (_set_image("."), "record.rounds[0].image"),
    "image is a folder": (lambda shard, record, other: _replace_image(shard, record, Path.mkdir),
                          "record.rounds[0].image"),
    "image is a FIFO": (lambda shard, record, other: _replace_image(shard, record, os.mkfifo),
                        "record.rounds[0].image"),
    "another task's image": (_set_image(lambda other: other["rounds"][0]["image"]), "record.rounds[0].image"),
    "the run's config as image": (_set_image(layout.RUN_CONFIG), "record.rounds[0].image"),
    "disease 5": (_set("disease", 5), "record.disease"),
    "round 'x'": (lambda shard, record, other: record["rounds"][0].update(round="x"), "record.rounds[0].round"),
    "status 'weird'": (_set("status", "weird"), "record.status"),
    "dataset 'A\\nB'": (_set("dataset", "A\nB"), "record.dataset"),
    "dataset ''": (_set("dataset", ""), "record.dataset"),
    "dataset of 300 characters": (_set("dataset", "D" * 300), "record.dataset"),
    "uid of another task": (_set("uid", "DS/add/n0-Pneumothorax"), "uid"),
    "accepted round of a failed task": (_set("status", "failed"), "record.rounds[0].accepted"),
}


@pytest.mark.parametrize("existing_out", [False, True], ids=["new --out", "merged --out"])
@pytest.mark.parametrize("case", list(HOSTILE_RECORDS))
def test_merge_refuses_a_malformed_shard_record_naming_line_and_field_and_leaves_out_as_it_was(
        tmp_path, case, existing_out, capsys):
    spoil, field = HOSTILE_RECORDS[case]
    shard, out = tmp_path / "shard", tmp_path / "merged"
    first, hostile = legit(shard, "n0"), legit(shard, "n1")
    spoil(shard, hostile, first)
    make_shard(shard, [first, hostile])  # the honest task first: nothing of it may be written either
    if existing_out:  # --out holds an earlier merge, which must stay as it is
        assert main(["merge", str(make_shard(tmp_path / "earlier", [legit(tmp_path / "earlier", "e0")])),
                     "--out", str(out)]) == 0
    before = snapshot(out) if existing_out else None
    tree_before = tree(tmp_path)
    capsys.readouterr()
    assert main(["merge", str(shard), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"medbanana merge: error: shard {shard}, {layout.JOURNAL} line 2: field '{field}'"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert tree(tmp_path) == tree_before
    assert (snapshot(out) == before) if existing_out else not out.exists()


@pytest.mark.parametrize("make, kind", [(Path.mkdir, "a folder"), (os.mkfifo, "a FIFO (named pipe)")],
                         ids=["folder", "FIFO"])
def test_merge_refuses_a_shard_journal_that_is_not_a_file(tmp_path, make, kind, capsys):
    shard, out = make_shard(tmp_path / "shard", [legit(tmp_path / "shard", "n0")]), tmp_path / "merged"
    (shard / layout.JOURNAL).unlink()
    make(shard / layout.JOURNAL)
    assert main(["merge", str(shard), "--out", str(out)]) == 2  # a FIFO is never opened: this does not hang
    err = capsys.readouterr().err
    assert err == f"medbanana merge: error: shard {shard}: {layout.JOURNAL}: not a regular file but {kind}\n"
    assert not out.exists()


# ---------------------------------------------------------------- dataset card

EVIL = "<img src=x onerror=alert(1)>"
DATASET = f"ds#{EVIL}|pipe"
DISEASE = f"Evil#{EVIL}|cell`tick`[link](http://evil.example)"
RUN = "run`<b>bold`|#[x](y)"  # a folder name: no "/"
REASON = f"<script>alert(1)</script> | # heading [click](http://evil.example) `code` {EVIL}"


@pytest.fixture(scope="module")
def hostile_card(tmp_path_factory) -> str:
    """README.md of a dataset built from a run whose names and verdict reasons carry Markdown and HTML."""
    root = tmp_path_factory.mktemp("card")
    run, key, rounds = root / RUN, f"s0-{DISEASE}", []
    for n, accepted in ((1, False), (2, True)):
        rel = layout.attempt_image_relpath(DATASET, "add", "s0", DISEASE, n, accepted)
        write_jpeg(run / rel, n)
        rounds.append({"round": n, "generate_prompt": {"prompt": f"add it, try {n}", "thinking_summary": ""},
                       "edit_result": {"success": True},
                       "verification": {"qualified": accepted, "has_disease": accepted, "structure_reasonable": True,
                                        "looks_realistic": True, "reason": "fine" if accepted else REASON}})
    out_dir = layout.output_dir(run, DATASET, "add")
    (out_dir / layout.ALL_CONVERSATIONS).write_text(json.dumps({key: {
        "image": "s0.jpeg", "disease": DISEASE, "status": "success", "rounds": rounds,
        "final_prompt": "add it, try 2", "final_image_path": "/elsewhere/x.jpeg"}}))
    (out_dir / layout.PROGRESS).write_text(json.dumps({key: "success"}))
    build([run], root / "ds", quiet=True)
    return (root / "ds" / "README.md").read_text().split("---\n", 2)[2]  # the body, after the YAML


def test_card_escapes_names_and_reasons_in_its_markdown(hostile_card):
    card = hostile_card
    for raw in ("<img", "<script", "<b>", "[link](", "[click]("):
        assert raw not in card, raw
    lines = card.splitlines()
    rows = [i for i, line in enumerate(lines) if "Evil" in line or "ds\\#" in line or "&lt;script" in line]
    assert len(rows) >= 3  # disease table, datasets table, failure reasons
    for i in rows:
        assert re.search(r"(?<!\\)`", lines[i]) is None, lines[i]  # no code span opened by data
        rule = next(line for line in reversed(lines[:i]) if line.startswith("|-"))  # the table's |---|---| line
        assert lines[i].count("|") == rule.count("|"), (lines[i], rule)  # no extra cell from a data `|`
    assert not [line for line in card.splitlines() if line.startswith("#") and ("heading" in line or "Evil" in line)]
    assert "ds\\#&lt;img src=x onerror=alert(1)&gt;&#124;pipe" in card


class _Html(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.text, self.imgs, self.headings, self._in = Counter(), [], [], [], None

    def handle_starttag(self, tag, attrs):
        self.tags[tag] += 1
        self.imgs += [dict(attrs).get("src")] if tag == "img" else []
        self._in = tag if re.fullmatch(r"h\d", tag) else self._in

    def handle_endtag(self, tag):
        self._in = None if tag == self._in else self._in

    def handle_data(self, data):
        self.text.append(data)
        if self._in:
            self.headings.append(data)


def test_card_renders_data_as_text_only(hostile_card):
    markdown_it = pytest.importorskip("markdown_it")
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(hostile_card)
    page = _Html()
    page.feed(html)
    assert not {"a", "script", "b"} & set(page.tags), page.tags
    assert set(page.imgs) <= {"figure3.png"}  # only the card's own Figure 3
    text = "".join(page.text)
    for value in (DATASET, DISEASE, RUN):
        assert value in text, value  # shown literally, as text
    assert not [h for h in page.headings if "Evil" in h or "heading" in h]
    for table in re.findall(r"<table>.*?</table>", html, re.DOTALL):
        widths = {len(re.findall(r"<t[hd][ >]", row)) for row in re.findall(r"<tr>.*?</tr>", table, re.DOTALL)}
        assert len(widths) == 1, table


# ---------------------------------------------------------------- XMP mark

NAME = "scan\x00\x01\x1b[31m<&\"'>\x7f\ud800\uffff\r\n\tend"
SANITISED = "scan\ufffd\ufffd\ufffd[31m<&\"'>\x7f\ufffd\ufffd\r\n\tend"


def _image(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (90, 20, 200)).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_xmp_mark_with_control_characters_and_markup_reads_back(fmt):
    assert xmp_text(NAME) == SANITISED
    marked = mark_synthetic(_image(fmt), "run<&>\x02", {"editor": "model\x03<e>"}, extra={"Task": NAME},
                            note="note\x0c & <b>")
    ElementTree.fromstring(xmp_of(marked).strip(b"\x00 \r\n\t"))  # well-formed
    mark = read_mark(marked)
    assert mark is not None
    assert mark.properties["Task"] == SANITISED
    assert (mark.run_id, mark.models, mark.description) == ("run<&>\ufffd", {"editor": "model\ufffd<e>"},
                                                            "note\ufffd & <b>")
    assert Image.open(io.BytesIO(marked)).size == (8, 8)


def test_generator_marks_an_image_of_a_source_named_with_control_characters(tmp_path):
    stem = "src\x01\x1f<&>\"'"
    task = Task(dataset="DS", modality="chest_xray", disease="Pneumothorax", direction="add",
                source_path=tmp_path / f"{stem}.jpeg")
    store = RunStore(tmp_path / "run", {"run_id": "r1", "models": {"editor": "simulated\x02"}}).open()
    try:
        attempt = Attempt(round=1, instruction=Instruction(text="add it"), accepted=True)
        store.write_attempt(task, attempt, EditedImage(data=_image("JPEG")))
    finally:
        store.close()
    mark = read_mark((tmp_path / "run" / attempt.image_relpath).read_bytes())
    assert mark is not None and mark.properties["Task"] == "DS/add/src\ufffd\ufffd<&>\"'-Pneumothorax"
    assert mark.models == {"editor": "simulated\ufffd"}
