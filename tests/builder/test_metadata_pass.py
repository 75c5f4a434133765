"""The fast paths of the build's metadata pass (issue 18) give what the plain paths give: the failure-reason
clauses counted in bulk, `all_conversations.json` decoded in one pass, and the containment check's cache."""

import json
import os
import random
from collections import Counter
from pathlib import Path

import pytest
from medbanana.generation.rundir import run_json
from medbanana.builder.reasons import count_phrases, reason_phrases
from medbanana.generation.rundir.runs import discover_units, read_tasks
from medbanana.generation.rundir.confined import Confined, Refused
from medbanana.builder.synthetic_run import make_synthetic_run
from medbanana.generation.rundir import schema

# characters that send a text down each branch of reason_phrases: separators, brackets, digits, blanks, non-ASCII
_ALPHABET = list("abcXYZ  .;,:-()[]0123456789\n\t\x7f%+?") + ["é", "İ", "\u00a0", "\u2028"]


def _texts(seed: int, n: int, alphabet=_ALPHABET) -> Counter:
    rng = random.Random(seed)
    words = "the edit is too subtle margins blend hard edges lesion border effusion".split()
    texts = Counter()
    for _ in range(n):
        if rng.random() < 0.6:  # plain clauses, as most synthetic verdicts are
            text = " ".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
            text = text.upper() if rng.random() < 0.1 else text
            text = rng.choice(["", " ", "- ", ", "]) + text + rng.choice(["", " -", ":", ","])  # stripped
        else:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        texts[text] += rng.randint(1, 3)
    return texts


@pytest.mark.parametrize("seed", range(4))
def test_clauses_counted_in_bulk_are_those_of_each_text(seed):
    # more than one chunk of count_phrases; one seed with texts holding its separator, \x00
    texts = _texts(seed, 6000, _ALPHABET + ["\x00"] if seed == 3 else _ALPHABET)
    expected = Counter()
    for text, n in texts.items():
        for phrase in reason_phrases(text):
            expected[phrase] += n
    counted = Counter()
    count_phrases(texts, counted)
    assert counted == expected and list(counted) == list(expected)
    assert any(len(reason_phrases(text)) > 1 for text in texts)  # the general path was taken too


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("metadata")
    make_synthetic_run(root / "run", flavor="ours", tasks_per_folder=12, api_failed_per_folder=1,
                       write_images=False, seed=3)
    return root / "run"


def test_a_file_decoded_in_one_pass_equals_it_decoded_entry_by_entry(run):
    path = next(run.glob("*/all_conversations.json"))
    data = path.read_bytes()
    whole = run_json.conversations(data, path)
    one_by_one = {key: run_json.decode_entry(schema.CONVERSATION, raw, path, key)
                  for key, raw in run_json.entries(data, path).items()}
    assert list(whole) == list(one_by_one) and len(whole) == 12
    assert all(msgspec_fields(whole[key]) == msgspec_fields(one_by_one[key]) for key in whole)


def msgspec_fields(entry) -> dict:
    import msgspec

    return msgspec.json.decode(msgspec.json.encode(entry))


def test_one_pass_decoding_leaves_malformed_and_repeated_entries_to_the_exact_paths(run, tmp_path):
    path = next(run.glob("*/all_conversations.json"))
    data = json.loads(path.read_text())
    key = next(iter(data))
    malformed = {**data, key: {**data[key], "rounds": "not a list"}}
    assert run_json.conversations(json.dumps(malformed).encode(), path) is None  # the caller refuses it by name
    twice = json.dumps(data)[:-1] + ", " + json.dumps({key: data[key]})[1:]  # the same key and value again
    with pytest.raises(ValueError, match="appears more than once"):
        run_json.conversations(twice.encode(), path)


def test_reading_a_unit_whole_or_in_blocks_gives_the_same_tasks(run):
    unit = discover_units(run)[0]
    whole = read_tasks(unit)  # one pass
    blocks = read_tasks(unit, 0, 2) + read_tasks(unit, 1, 2)  # entry by entry
    assert whole == blocks and len(whole) == 13 and any(task.attempts for task in whole)


def test_the_containment_cache_is_kept_per_root_and_never_passes_an_odd_name(tmp_path):
    inner, outer = tmp_path / "run", tmp_path / "other"
    (inner / "x").mkdir(parents=True)
    outer.mkdir()
    os.symlink(inner / "x", outer / "x")  # the same name, leading out of the second root
    confined = Confined()
    confined.check(inner, "x/a.jpeg", "test")  # cached: x is inside `inner`
    confined.check(inner, "x/b.jpeg", "test")
    with pytest.raises(Refused, match="outside"):
        confined.check(outer, "x/a.jpeg", "test")
    with pytest.raises(Refused, match="not a usable path"):  # in a cached folder, a name no file has
        confined.check(inner, "x/a\x00.jpeg", "test")
