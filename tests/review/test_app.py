"""`medbanana review` without a browser: the command's forms and its one-line errors, the page's answer mapping,
the Hugging Face sign-in on a Space, and export / report through the command line (the browser tests drive the
page itself: test_browser.py)."""

import pytest
from review_browser import make_run

from medbanana.cli import main
from medbanana.generation.records import VERDICT_BOOLEANS
from medbanana.review.app import RUBRIC_QUESTIONS, answer_from_page
from medbanana.generation.dataset.review_folder import Answer
from medbanana.review.store import ReviewStore


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("review_cli_run"))


def review_error(capsys, argv: list[str]) -> str:
    """The one line `medbanana review ...` prints for bad input (exit code 2)."""
    assert main(["review", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("medbanana review: error: "), lines
    return lines[0]


def test_help_names_all_three_forms_and_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["review", "--help"])
    out = capsys.readouterr().out
    for form in ("medbanana review SOURCE --out REVIEW_DIR", "medbanana review REVIEW_DIR",
                 "medbanana review export REVIEW_DIR --out labels.csv", "medbanana review report REVIEW_DIR --out DIR"):
        assert form in out
    defaults = (("--items", "100"), ("--raters-per-item", "2"), ("--port", "7860"), ("--host", "127.0.0.1"))
    for option, default in defaults:
        assert option in out and f"default {default}" in out
    assert "rubric" in out and "realism" in out and "judge-agreement" in out



@pytest.mark.parametrize("verb, own, others", [
    ("export", ("--out", "--rater", "labels CSV"), ("--bootstrap", "--mode", "--items", "--port", "SOURCE")),
    ("report", ("--out", "--bootstrap", "--seed", "report folder"), ("--rater", "--mode", "--items", "--port")),
])
def test_a_forms_help_shows_that_form_only(capsys, verb, own, others):
    for argv in (["review", verb, "--help"], ["review", verb, "some-review", "--out", "x", "-h"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: medbanana review {verb} REVIEW_DIR --out")
        assert all(word in out for word in own), out
        assert not any(word in out for word in others), out
        assert "creating:" not in out  # each option's help says what it does in this form only

def test_the_page_turns_its_inputs_into_an_answer():
    rubric = answer_from_page("rubric", ["Yes", "No", "Yes", None, "No", "  blurred edge  "], seconds=4.5)
    assert [getattr(rubric, name) for name, _ in RUBRIC_QUESTIONS] == [True, False, True, None, False]
    assert rubric.reason == "blurred edge" and rubric.seconds == 4.5
    assert {name for name, _ in RUBRIC_QUESTIONS} == set(VERDICT_BOOLEANS)  # every rubric dimension is asked
    realism = answer_from_page("realism", ["edited", 4], seconds=None)
    assert (realism.guess, realism.confidence, realism.has_disease) == ("edited", 4, None)
    assert answer_from_page("realism", [None, None], seconds=1.0).confidence is None


@pytest.mark.slow
def test_on_a_space_raters_sign_in_with_hugging_face(small_run, tmp_path, monkeypatch):
    run, sources = small_run
    assert main(["review", str(run), "--out", str(tmp_path / "review"), "--items", "2", "--no-serve",
                 "--source-images", str(sources)]) == 0
    from medbanana.review.app import build_page, load_gradio

    gr = load_gradio()
    store = ReviewStore.open(tmp_path / "review")

    def login_buttons() -> int:
        return sum(isinstance(block, gr.LoginButton) for block in build_page(store).blocks.values())

    monkeypatch.delenv("SPACE_ID", raising=False)
    assert login_buttons() == 0
    monkeypatch.setenv("SPACE_ID", "someone/review-panel")
    try:
        import authlib  # noqa: F401
        import itsdangerous  # noqa: F401
    except ImportError:  # gradio's sign-in needs gradio[oauth]: without it, the page says what to install
        with pytest.raises(ImportError, match=r"signing in with Hugging Face .*pip install 'medbanana\[review\]'"):
            login_buttons()
        return
    # what a Space with `hf_oauth: true` sets (gradio reads its OAuth settings once, at import)
    monkeypatch.setenv("SYSTEM", "spaces")
    for name, value in (("OAUTH_CLIENT_ID", "id"), ("OAUTH_CLIENT_SECRET", "secret"), ("OAUTH_SCOPES", "openid"),
                        ("OPENID_PROVIDER_URL", "https://huggingface.co")):
        monkeypatch.setattr(gr.oauth, name, value)
    assert login_buttons() == 1


def test_bad_input_gives_one_clear_line(small_run, tmp_path, capsys):
    run, sources = small_run
    review = tmp_path / "review"
    assert "no such dataset or run" in review_error(capsys, [str(tmp_path / "nope"), "--out", str(review)])
    (tmp_path / "empty").mkdir()
    empty = review_error(capsys, [str(run), "--out", str(review), "--source-images", str(tmp_path / "empty")])
    assert "no edit with both its source and edited image" in empty
    assert "--items must be at least 1" in review_error(capsys, [str(run), "--out", str(review), "--items", "0",
                                                                 "--source-images", str(sources)])
    assert not review.exists()

    assert main(["review", str(run), "--out", str(review), "--items", "3", "--seed", "5", "--no-serve",
                 "--source-images", str(sources)]) == 0
    out = capsys.readouterr().out
    assert "created review" in out and "3 rubric items" in out and f"medbanana review {review}" in out
    assert "already holds a review" in review_error(capsys, [str(run), "--out", str(review), "--no-serve"])
    assert "is a review folder, not a dataset or run" in review_error(capsys, [str(review), "--out", str(tmp_path)])
    assert "--items does not apply to serving" in review_error(capsys, [str(review), "--items", "5"])
    assert "--mode, --seed do not apply" in review_error(capsys, [str(review), "--mode", "realism", "--seed", "1"])
    assert "not a review folder" in review_error(capsys, [str(run)])
    assert "--rater does not apply" in review_error(capsys, ["report", str(review), "--out", str(tmp_path / "r"),
                                                             "--rater", "Ana"])
    assert "needs --out" in review_error(capsys, ["export", str(review)])
    assert "expected one SOURCE or REVIEW_DIR" in review_error(capsys, [str(run), str(review)])
    assert len(ReviewStore.open(review).items()) == 3 and ReviewStore.open(review).answers() == []


def test_export_and_report_run_from_the_command_line(small_run, tmp_path, capsys):
    run, sources = small_run
    review = tmp_path / "review"
    assert main(["review", str(run), "--out", str(review), "--items", "4", "--no-serve",
                 "--source-images", str(sources)]) == 0
    store = ReviewStore.open(review)
    for rater in ("Ana", "Ben"):
        while (item := store.next_item(rater)) is not None:
            yes = (rater == "Ana") or item.item_id.endswith(("1", "3"))
            store.submit(rater, item.item_id, Answer(**dict.fromkeys(VERDICT_BOOLEANS, yes), seconds=2.0))
    capsys.readouterr()
    labels = tmp_path / "labels.csv"
    assert main(["review", "export", str(review), "--out", str(labels), "--rater", "Ben"]) == 0
    out = capsys.readouterr().out
    assert "wrote 4 labelled edits" in out and "rater Ben" in out
    rows = labels.read_text().splitlines()
    assert len(rows) == 5 and rows[0].startswith("id,")
    report = tmp_path / "report"
    assert main(["review", "report", str(review), "--out", str(report), "--bootstrap", "50", "--seed", "3"]) == 0
    assert (report / "report.md").is_file() and f"wrote {report / 'report.md'}" in capsys.readouterr().out


@pytest.mark.slow
def test_a_taken_port_is_one_clear_line(small_run, tmp_path, capsys):
    import socket

    run, sources = small_run
    review = tmp_path / "review"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        line = review_error(capsys, [str(run), "--out", str(review), "--items", "2", "--port", port,
                                      "--source-images", str(sources)])
        assert f"cannot serve on 127.0.0.1:{port}: the port is in use" in line
        assert f"the review is created: serve it with `medbanana review {review}" in line
        assert "the port is in use" in review_error(capsys, [str(review), "--port", port])
    assert len(ReviewStore.open(review).items()) == 2
