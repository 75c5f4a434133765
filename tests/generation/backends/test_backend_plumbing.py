"""What the backends share: prompts without an API client, per-run limiters, typed settings, the registry."""

import dataclasses
import json
import pickle
import subprocess
import sys

import pytest

from medbanana.generation import backends
from medbanana.generation.backends.settings import DiffusersSettings, GeminiSettings, OpenAISettings
from medbanana.generation.prompts import JudgeAnswer, parse_verdict, verdict_from_answer
from medbanana.generation.records import VERDICT_BOOLEANS, Task, Usage
from medbanana.generation.runners.generate import BackendSpec

KEY = "AIza-test-plumbing-0123456789"


@pytest.mark.slow
@pytest.mark.parametrize("module", ["medbanana.generation.prompts", "medbanana.loaders.trl",
                                    "medbanana.evaluation.judging"])
def test_prompt_users_do_not_import_the_gemini_client(module):
    code = f"import sys, {module}; print('google.genai' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_judge_answer_has_the_verdicts_booleans_and_becomes_a_verdict():
    assert list(JudgeAnswer.model_fields) == [*VERDICT_BOOLEANS, "reason"]
    raw = dict.fromkeys(VERDICT_BOOLEANS, True) | {"reason": "ok"}
    verdict = verdict_from_answer(parse_verdict(json.dumps(raw)), Task("d", "chest_xray", "x", "remove", "s.png"),
                                  thinking="", model="m", usage=Usage(), details={})
    # has_disease after remove is not compliant: not qualified whatever the model said, and the rubric says so
    assert all(getattr(verdict, name) for name in VERDICT_BOOLEANS if name != "qualified")
    assert not verdict.qualified and verdict.details["qualified_overridden"] and verdict.score == pytest.approx(0.6)


def test_two_transports_with_one_model_and_rpm_do_not_share_a_limiter(monkeypatch):
    from medbanana.generation.backends.gemini_transport import GeminiTransport

    monkeypatch.setenv("GEMINI_API_KEY", KEY)
    first, second = GeminiTransport(rpm=6, tpm=1000), GeminiTransport(rpm=6, tpm=1000)
    assert first.limits.requests("m").reserve() == 0.0
    assert second.limits.requests("m").reserve() == 0.0  # a shared limiter would make this one wait 10 s
    assert first.limits.requests("m").reserve() > 9.0  # within one transport the model's quota is shared
    assert first.limits.requests("other").reserve() == 0.0
    first.limits.tokens("m").record(1000)
    assert first.limits.tokens("m").wait_time() > 0 and second.limits.tokens("m").wait_time() == 0.0


def test_settings_share_their_rate_limits_and_pickle():
    gemini = GeminiSettings(rpm=120.0, tpm=9e5, timeout=5)
    assert gemini.share(3) == dataclasses.replace(gemini, rpm=40.0, tpm=3e5)
    assert OpenAISettings(rpm=60.0).share(4).rpm == 15.0 and OpenAISettings().share(4).rpm is None
    assert DiffusersSettings(steps=3).share(2) == DiffusersSettings(steps=3)
    spec = BackendSpec("simulator", dict.fromkeys(backends.ROLES, "simulator"), gemini={"rpm": 10.0})
    assert spec.gemini == GeminiSettings(rpm=10.0)
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.gemini.rpm = 1.0


def test_diffusers_settings_are_the_editors_options(tmp_path):
    roles = {"writer": "simulator", "editor": "diffusers", "judge": "simulator"}
    options = DiffusersSettings(model="m", steps=3).options(tmp_path, roles)
    assert options["editor"]["model"] == "m" and options["editor"]["steps"] == 3
    assert DiffusersSettings().options(tmp_path, dict.fromkeys(backends.ROLES, "simulator")) == {}


def test_the_built_in_registry_is_read_only_and_backends_are_added_per_process():
    with pytest.raises(TypeError):
        backends.BUILTIN["mine"] = {"judge": "x:Y"}
    with pytest.raises(TypeError):
        backends.BUILTIN["gemini"]["judge"] = "x:Y"
    target = "medbanana.generation.backends.simulator.judge:PixelJudge"
    assert type(backends.create("judge", target)).__name__ == "PixelJudge"  # an import string, unregistered
    backends.register("mine", "judge", target)
    try:
        assert "mine" in backends.available("judge") and "mine" not in backends.available("writer")
    finally:
        backends.unregister("mine")
    assert "mine" not in backends.available("judge")
    with pytest.raises(ValueError, match="no judge backend named 'mine'"):
        backends.create("judge", "mine")


def test_backends_say_which_prompts_they_send():
    from medbanana.generation.backends.gemini import GeminiEditor, GeminiJudge, GeminiWriter
    from medbanana.generation.backends.openai_compatible import OpenAIJudge, OpenAIWriter
    from medbanana.generation.runners.generate import prompts_used

    assert set(prompts_used(GeminiWriter, GeminiEditor, GeminiJudge)) == {
        "writer_add", "writer_remove", "writer_refine", "editor", "judge"}
    assert set(prompts_used(OpenAIWriter, backends.backend_class("editor", "simulator"), OpenAIJudge)) == {
        "writer_add", "writer_remove", "writer_refine", "judge"}
    assert prompts_used(*(backends.backend_class(role, "simulator") for role in backends.ROLES)) == {}
