"""The openai-compatible writer and judge against the fake chat-completions server, through the real openai client.

Back-off sleeps are recorded instead of slept, so Retry-After is checked without waiting for it.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("openai", reason="the openai backend needs `pip install 'medbanana[openai]'`")

from fake_runs import chest_source  # noqa: E402
from medbanana.generation import backends  # noqa: E402
from medbanana.generation.backends import APIError  # noqa: E402
from medbanana.generation.testing.fake_openai import FakeOpenAI  # noqa: E402
from medbanana.generation.backends.openai_compatible import OpenAIJudge, OpenAIWriter  # noqa: E402
from medbanana.generation.prompts import parse_verdict_tolerant  # noqa: E402
from medbanana.generation.records import (Attempt, EditedImage, SourceImage, Task, decode_rgb, encode_jpeg,  # noqa: E402
                                          rubric_score)

KEY = "sk-test-4e1b9d0c7a"  # distinctive, so that a leak is found by search
MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


@pytest.fixture(scope="module")
def fake():
    with FakeOpenAI() as server:
        yield server


@pytest.fixture
def options(fake, sleeps, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    fake.reset()
    return {"model": MODEL, "base_url": fake.base_url, "timeout": 5.0, "max_attempts": 3,
            "retry_base_delay": 0.01, "retry_max_delay": 0.05, "sleep": sleeps}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> SourceImage:
    return chest_source(tmp_path_factory.mktemp("src"), size=128)


def make_task(source: SourceImage, direction: str = "add") -> Task:
    return Task("cxr_demo", "chest_xray", "Pleural_Effusion", direction, source.path)


def edited_from(source: SourceImage) -> EditedImage:
    return EditedImage(data=encode_jpeg(np.clip(source.array.astype(int) + 10, 0, 255)))


def run(coro):
    return asyncio.run(coro)


def test_registry_builds_openai_writer_and_judge(options):
    assert isinstance(backends.create("writer", "openai", **options), OpenAIWriter)
    assert isinstance(backends.create("judge", "openai", **options), OpenAIJudge)
    assert "openai" not in backends.available("editor")


def test_write_judge_refine_with_the_shared_prompts(fake, options, source):
    task = make_task(source)
    writer, judge = OpenAIWriter(**options), OpenAIJudge(**options)

    async def rounds():
        first = await writer.write(task, source, [])
        verdict = await judge.judge(task, source, edited_from(source), first.text)
        second = await writer.write(task, source, [Attempt(1, first, verdict)])
        return first, verdict, second

    first, verdict, second = run(rounds())
    assert first.text and not first.text.lower().startswith("instruction:")  # the label is cleaned off
    assert first.model == MODEL and first.usage.input_tokens > 0
    assert verdict.details["structured_output"] == "json_schema" and verdict.details["tries"] == 1
    assert verdict.score == pytest.approx(rubric_score(verdict.compliance("add"), verdict.structure_reasonable,
                                                       verdict.looks_realistic, verdict.fidelity_preserved))
    assert second.text
    assert [c.role for c in fake.calls] == ["writer", "judge", "writer"]
    assert [c.response_format for c in fake.calls] == ["", "json_schema", ""]
    assert {c.authorization for c in fake.calls} == {f"Bearer {KEY}"}  # key from the environment


def test_a_server_without_json_mode_falls_back_to_the_tolerant_parser(fake, options, source):
    fake.reset(structured_output=False)
    judge = OpenAIJudge(**options)

    async def twice():  # one event loop, as in a run: the client's connections belong to it
        return [await judge.judge(make_task(source), source, edited_from(source), "Add a small effusion.")
                for _ in range(2)]

    first, second = run(twice())
    assert "response_format rejected" in first.details["structured_output_fallback"]
    assert first.details["structured_output"] == "none" and "structured_output_fallback" not in second.details
    assert [c.response_format for c in fake.calls] == ["json_schema", "", ""]  # not asked for again


def test_think_blocks_become_the_thinking_summary(fake, options, source):
    fake.reset(think=True)
    instruction = run(OpenAIWriter(**options).write(make_task(source), source, []))
    verdict = run(OpenAIJudge(**options).judge(make_task(source), source, edited_from(source), instruction.text))
    assert "<think>" not in instruction.text and "Looking at the add task" in instruction.thinking_summary
    assert "Looking at the add task" in verdict.thinking_summary


def test_429_is_retried_after_its_retry_after(fake, options, sleeps, source):
    fake.reset(["429:first=2,retry_after=7"])
    instruction = run(OpenAIWriter(**options).write(make_task(source), source, []))
    assert instruction.text and fake.count("writer") == 3
    assert len(sleeps) == 2 and all(s >= 7 for s in sleeps)


def test_5xx_gives_up_after_max_attempts(fake, options, source):
    fake.reset(["503"])
    with pytest.raises(APIError) as caught:
        run(OpenAIWriter(**options).write(make_task(source), source, []))
    assert caught.value.kind == "server_error" and "gave up after 3 attempts" in str(caught.value)
    assert fake.count() == 3


def test_unusable_verdicts_are_reasked_then_fail(fake, options, source):
    fake.reset(["malformed_json:first=1"])
    verdict = run(OpenAIJudge(**options).judge(make_task(source), source, edited_from(source), "Add it."))
    assert verdict.details["tries"] == 2
    fake.reset(["truncated_json"])
    with pytest.raises(APIError) as caught:
        run(OpenAIJudge(**options, max_reasks=1).judge(make_task(source), source, edited_from(source), "Add it."))
    assert caught.value.kind == "unparseable_verdict" and fake.count("judge") == 2


def test_refusal_and_client_errors_are_not_retried_and_the_key_is_redacted(fake, options, source):
    fake.reset(["safety:first=1"])
    with pytest.raises(APIError) as refused:
        run(OpenAIWriter(**options).write(make_task(source), source, []))
    assert refused.value.kind == "refused" and fake.count() == 1
    fake.reset(["invalid_argument:first=1"])
    with pytest.raises(APIError) as invalid:
        run(OpenAIWriter(**options).write(make_task(source), source, []))
    assert invalid.value.kind == "invalid_argument" and fake.count() == 1
    assert KEY not in str(invalid.value) and "[redacted]" in str(invalid.value)


def test_tolerant_parser_reads_json_in_prose_and_rejects_incomplete_verdicts():
    body = ('{"has_disease": true, "structure_reasonable": true, "looks_realistic": false, '
            '"fidelity_preserved": true, "qualified": false, "reason": "too bright"}')
    assert parse_verdict_tolerant(f"My verdict is {body} as requested.").looks_realistic is False
    with pytest.raises(ValueError):
        parse_verdict_tolerant('Verdict: {"has_disease": true}')
    with pytest.raises(ValueError):
        parse_verdict_tolerant("no json here")


def test_a_connection_error_is_retried_then_reported(options, source):
    options = {**options, "base_url": "http://127.0.0.1:9/v1"}  # discard port: nothing listens
    with pytest.raises(APIError) as caught:
        run(OpenAIWriter(**options).write(make_task(source), source, []))
    assert caught.value.kind == "transport"


@pytest.mark.slow
def test_generate_mixes_an_openai_writer_and_judge_with_a_diffusers_editor(fake, tiny_sources, tmp_path,
                                                                             monkeypatch, capsys):
    """The full open pipeline from the command line: a tiny diffusers pipeline saved to a folder edits, the fake
    server writes and judges."""
    pytest.importorskip("diffusers")
    from medbanana.cli import main
    from medbanana.dpo.tiny import tiny_instruct_pix2pix
    from medbanana.generation.rundir import layout
    from medbanana.evaluation.attention import recorded_attention

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # a local server needs no key
    fake.reset()
    tiny_instruct_pix2pix(["add a pneumothorax", "remove the pneumothorax"], resolution=64).save_pretrained(
        tmp_path / "tiny-ip2p")
    run_dir = tmp_path / "run"
    code = main(["generate", "--sources", str(tiny_sources), "--out", str(run_dir), "--diseases", "Pneumothorax",
                 "--writer", "openai", "--judge", "openai", "--editor", "diffusers",
                 "--openai-base-url", fake.base_url, "--openai-model", MODEL,
                 "--editor-model", str(tmp_path / "tiny-ip2p"), "--diffusers-steps", "2",
                 "--diffusers-resolution", "64", "--device", "cpu", "--max-rounds", "2", "--timeout", "10",
                 "--diffusers-attention", "-q"])
    assert code == 0, capsys.readouterr().err
    assert "tasks 3 (ran 3" in capsys.readouterr().out
    stats = json.loads((run_dir / layout.STATS).read_text())
    assert stats["api_failed"] == 0 and stats["success"] + stats["failed"] == 3
    config = json.loads((run_dir / layout.RUN_CONFIG).read_text())
    assert {role: d["backend"] for role, d in config["backends"].items()} == {
        "writer": "openai", "editor": "diffusers", "judge": "openai"}
    assert config["models"]["judge"] == MODEL and "judge" in config["prompts"]
    assert fake.count("judge") >= 3 and fake.count("writer") >= 3  # every task edited and judged at least once
    assert {c.authorization for c in fake.calls} == {"Bearer not-needed"}
    edits = [p for p in run_dir.rglob("*.jpeg") if layout.MASKS not in p.relative_to(run_dir).parts]
    assert len(edits) >= 3 and all(decode_rgb(p.read_bytes()).std() > 0 for p in edits)
    recorded, problems = recorded_attention([run_dir])  # the simulator writer names the disease: each edit has an IoU
    assert problems == [] and len(recorded) == len(edits) and {r["disease"] for r in recorded.values()} == {"Pneumothorax"}
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--source-images", str(tiny_sources), "--out", str(tmp_path / "eval"),
                 "--all-attempts", "--judge", "none",
                 "--attention", "-q"]) == 0
    assert "attention Pneumothorax: n " in capsys.readouterr().out
    report = json.loads((tmp_path / "eval" / "attention.json").read_text())
    assert {r["id"] for r in report["samples"]} == set(recorded)  # a run's edit mask is computed from its edits
    assert report["by_disease"]["Pneumothorax"] == {**report["by_disease"]["Pneumothorax"], "n": len(edits),
                                                    "roi": {"edit_mask": len(edits)}}


def test_an_openai_role_without_a_model_is_one_clear_error(tiny_sources, tmp_path, capsys):
    from medbanana.cli import main

    code = main(["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / "run"), "--writer", "openai",
                 "--judge", "openai", "--editor", "simulator", "--openai-base-url", "http://127.0.0.1:9/v1", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "needs a model: --openai-model" in err and "Traceback" not in err


def test_answers_are_cached_and_unusable_ones_forgotten(fake, options, source, tmp_path):
    options = {**options, "cache_dir": tmp_path / "cache"}
    task = make_task(source)

    async def twice():
        writer = OpenAIWriter(**options)
        return [await writer.write(task, source, []) for _ in range(2)], writer.transport

    (first, again), transport = run(twice())
    assert first.text == again.text and fake.count("writer") == 1 and transport.cache_hits == 1
    assert KEY not in "".join(p.read_text() for p in (tmp_path / "cache").rglob("*.json"))
    fake.reset(["truncated_json:first=2"])
    with pytest.raises(APIError):
        run(OpenAIJudge(**options, max_reasks=1).judge(task, source, edited_from(source), first.text))
    verdict = run(OpenAIJudge(**options, max_reasks=1).judge(task, source, edited_from(source), first.text))
    assert fake.count("judge") == 3 and verdict.details["tries"] == 1  # asked again, not replayed
