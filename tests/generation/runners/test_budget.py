"""Pay knowingly, through the real CLI against the fake Gemini server: a paid backend only when named, the first line
naming backends, models and the estimate, a --budget never passed (across resumes, --workers and --batch), the
command that goes on, and tokens and USD per role in the summary, medbanana-stats.json and the dataset card."""

import json
import shlex

import pytest

from fake_runs import mimic_sources, use_fake_gemini
from medbanana.cli import main
from medbanana.generation.costs import round_steps
from medbanana.generation.failures import EXIT_BUDGET
from medbanana.generation.pricing import load_prices
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.store import read_journal
from medbanana.generation.testing.fake_gemini import FakeGemini

KEY = "budget-test-key-51c7"
MODELS = {"writer": "gemini-2.5-pro", "editor": "gemini-2.5-flash-image", "judge": "gemini-2.5-pro"}


@pytest.fixture
def fake(monkeypatch):
    with FakeGemini(engine="echo", accept_rate=0.5) as server:
        use_fake_gemini(monkeypatch, server, KEY)
        yield server


def _spent(run_dir, batch: bool = False) -> float:
    """USD of every round the journal holds, priced here from the records (not from what the run says)."""
    prices, seen = load_prices(), {}
    for entry in read_journal(run_dir / layout.JOURNAL):
        rounds = [entry["round"]] if entry["type"] == "round" else entry["record"]["rounds"]
        for raw in rounds:
            seen[(entry["uid"], raw["round"])] = raw
    total = 0.0
    for raw in seen.values():
        for role, tokens, _ in round_steps(raw):
            assert tokens is not None, f"{role} usage not recorded"
            total += prices.cost("gemini", MODELS[role], {"input_tokens": tokens[0], "output_tokens": tokens[1]},
                                 batch=batch)
    return total


def _go_on(err: str) -> list[str]:
    line = next(line for line in err.splitlines() if line.startswith("to go on: "))
    command = shlex.split(line.removeprefix("to go on: "))
    assert command[0] == "medbanana" and command.count("--budget") == 1
    return command[1:]


@pytest.mark.slow
def test_no_paid_call_unless_a_paid_backend_is_named(fake, tmp_path, capfd):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_free", per_class=1)
    assert main(["generate", "--sources", str(sources), "--out", str(tmp_path / "free"), "--limit", "2", "-q"]) == 0
    err = capfd.readouterr().err
    assert fake.count() == 0  # the key is set, and nothing went to the (fake) Gemini
    first = err.splitlines()[0]
    assert first.startswith("medbanana generate: writer simulator") and "--backend gemini" in first
    assert main(["generate", "--sources", str(sources), "--out", str(tmp_path / "paid"), "--limit", "2",
                 "--backend", "gemini", "-q"]) == 0
    first = capfd.readouterr().err.splitlines()[0]
    assert fake.count() > 0
    assert "writer gemini gemini-2.5-pro, editor gemini gemini-2.5-flash-image, judge gemini gemini-2.5-pro" in first
    assert "PAID: 2 task(s) to run, estimate" in first and "assumptions" in first


@pytest.mark.slow
def test_a_budget_is_never_passed_keeps_the_work_and_says_how_to_go_on(fake, tmp_path, capfd):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_budget", per_class=2)
    out = tmp_path / "run"
    argv = ["generate", "--sources", str(sources), "--out", str(out), "--backend", "gemini", "--max-rounds", "3",
            "--max-attempts", "1", "--budget", "0.5"]
    assert main(argv) == EXIT_BUDGET
    captured = capfd.readouterr()
    stats = json.loads((out / layout.STATS).read_text())
    assert 0 < _spent(out) <= 0.5 and stats["cost"]["usd"] == pytest.approx(_spent(out), abs=1e-3)
    assert stats["budget"]["reached"] and stats["budget"]["unfinished"] > 0
    assert "USD spent" in captured.err and "projected" in captured.err  # the progress bar
    assert "budget reached" in captured.err and "0.50 USD reached" in captured.out
    for role in ("writer", "editor", "judge"):  # tokens and USD per role and model, the editor's included
        line = stats["cost"]["roles"][role]
        assert line["model"] == MODELS[role] and line["input_tokens"] > 0 and line["usd"] > 0
    calls = fake.count()
    assert main(argv) == EXIT_BUDGET  # spent across invocations: nothing more fits, nothing is called
    assert fake.count() == calls
    for _ in range(3):  # the printed command, with its higher budget, goes on from what finished
        go_on = _go_on(capfd.readouterr().err)
        budget = float(go_on[go_on.index("--budget") + 1])
        code = main(go_on)
        assert _spent(out) <= budget
        if code == 0:
            break
        assert code == EXIT_BUDGET
    assert code == 0
    stats = json.loads((out / layout.STATS).read_text())
    assert stats["tasks"] == 2 * 11 + 2 and stats["success"] + stats["failed"] == stats["tasks"]
    assert main(["build", str(out), "--out", str(tmp_path / "dataset"), "-q"]) == 0
    card = (tmp_path / "dataset" / "README.md").read_text()
    section = card.split("### Cost to make this dataset")[1].split("## ")[0]
    assert "| editor | gemini-2.5-flash-image |" in section and "USD** at the standard prices" in section


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["workers", "batch"])
def test_the_budget_holds_with_worker_processes_and_the_batch_api(fake, tmp_path, capfd, mode):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_modes", per_class=2)
    out = tmp_path / "run"
    extra = ["--workers", "2", "--concurrency", "4"] if mode == "workers" else ["--batch", "--poll-interval", "0.02"]
    budget = 0.6 if mode == "workers" else 0.3
    assert main(["generate", "--sources", str(sources), "--out", str(out), "--backend", "gemini", "--max-rounds",
                 "3", "--max-attempts", "1", "--budget", str(budget), "-q", *extra]) == EXIT_BUDGET
    spent = _spent(out, batch=mode == "batch")
    assert 0 < spent <= budget
    assert json.loads((out / layout.STATS).read_text())["budget"]["unfinished"] > 0
    assert "to go on: medbanana generate" in capfd.readouterr().err


def test_a_budget_with_a_model_that_has_no_price_is_refused_before_any_call(fake, tmp_path, capfd):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_unpriced", per_class=1)
    code = main(["generate", "--sources", str(sources), "--out", str(tmp_path / "run"), "--backend", "gemini",
                 "--editor-model", "gemini-9-ultra-image", "--budget", "1", "-q"])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and fake.count() == 0
    assert "gemini-9-ultra-image has none" in err[-1] and "--prices FILE" in err[-1]


@pytest.mark.slow
def test_retry_failed_starts_only_api_failed_tasks_whatever_the_sources_hold_now(fake, tmp_path, capfd):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_retry", per_class=3)
    out = tmp_path / "run"
    fake.judge.accept_rate = 1.0
    fake.reset(["500:role=judge,rate=0.5"])
    assert main(["generate", "--sources", str(sources), "--out", str(out), "--backend", "gemini", "--diseases",
                 "Pneumothorax", "--limit", "4", "--max-rounds", "2", "--max-attempts", "1", "-q"]) == 3
    first = {e["uid"]: e["record"]["status"] for e in read_journal(out / layout.JOURNAL) if e["type"] == "task"}
    failed = {uid for uid, status in first.items() if status == "api_failed"}
    assert len(first) == 4 and 0 < len(failed) < 4
    folder = sources / "MIMIC_retry"  # new sources that sort first and last, in both directions' folders
    for name in ("normal/a000.jpeg", "normal/zzz9.jpeg", "Pneumothorax/a000.jpeg", "Pneumothorax/zzz9.jpeg"):
        (folder / name).write_bytes((folder / "normal" / "n0.jpeg").read_bytes())
    lines_before = len(read_journal(out / layout.JOURNAL))
    fake.reset()
    # the retry names its destinations itself (docs/data-destinations.md), as the run records them
    assert main(["generate", "--retry-failed", str(out), "--sources", str(sources), "--backend", "gemini", "-q"]) == 0
    entries = read_journal(out / layout.JOURNAL)
    after = {e["uid"]: e["record"]["status"] for e in entries if e["type"] == "task"}
    assert set(after) == set(first)  # no task added
    assert {uid for uid, status in after.items() if status != first[uid]} == failed
    ran = {e["uid"] for e in entries[lines_before:]}
    # the writer's and editor's answers come from the request cache; the judge, which failed, is asked again
    assert ran == failed and fake.count("judge") == sum(e["type"] == "round" for e in entries[lines_before:])


@pytest.mark.slow
def test_ray_shards_share_what_the_budget_leaves_and_each_keeps_to_its_part(fake, tmp_path):
    from medbanana.generation.backends.settings import GeminiSettings
    from medbanana.generation.runners.generate import BackendSpec
    from medbanana.generation.runners.ray_executor import ShardJob, run_shard, shard_budgets, shard_dir
    from medbanana.generation.runners.session import RunOptions

    sources = mimic_sources(tmp_path / "sources", "MIMIC_shards", per_class=2)
    spec = BackendSpec("gemini", dict.fromkeys(("writer", "editor", "judge"), "gemini"),
                       gemini=GeminiSettings(max_attempts=1, retry_base_delay=0.01))
    job = ShardJob(sources, spec, RunOptions(max_rounds=3, quiet=True), prices=load_prices(), budget=0.9)
    out = tmp_path / "out"
    first = run_shard(job, 0, 3, str(out), budget=0.3)  # shard 0 spends its part first (as a resubmission finds)
    assert first.budget_reached and _spent(shard_dir(out, 0, 3)) <= 0.3
    spent0 = _spent(shard_dir(out, 0, 3))
    budgets = shard_budgets(job, out, [0, 1, 2], 3)
    assert budgets[0] == pytest.approx(spent0 + (0.9 - spent0) / 3, abs=1e-3)
    assert sum(budgets.values()) == pytest.approx(0.9, abs=1e-3)  # together, never more than the job's budget
    for i in (1, 2):
        assert budgets[i] == pytest.approx((0.9 - spent0) / 3, abs=1e-3)
        run_shard(job, i, 3, str(out), budget=budgets[i])
        assert _spent(shard_dir(out, i, 3)) <= budgets[i]
    assert sum(_spent(shard_dir(out, i, 3)) for i in range(3)) <= 0.9
    assert shard_budgets(ShardJob(sources, spec, RunOptions()), out, [1], 3) == {1: None}
