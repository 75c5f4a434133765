"""`medbanana plan` through the CLI: the tasks generate would run, calls, tokens, USD and time with intervals, from
assumptions it labels or from a pilot run; prices overridden, a model without a price named."""

import json
from pathlib import Path

import pytest

from conftest import write_jpeg
from fake_runs import mimic_sources, use_fake_gemini
from medbanana.cli import main
from medbanana.generation.pricing import load_prices
from medbanana.generation.records import Task
from medbanana.generation.runners.pilot import Pilot, TaskSample
from medbanana.generation.runners.plan import PlanSetting, estimate
from medbanana.generation.testing.fake_gemini import FakeGemini

GEMINI = {"writer": {"backend": "gemini", "model": "gemini-2.5-pro"},
          "editor": {"backend": "gemini", "model": "gemini-2.5-flash-image"},
          "judge": {"backend": "gemini", "model": "gemini-2.5-pro"}}


def _plan(capsys, *argv) -> dict:
    assert main(["plan", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_without_a_pilot_the_figures_are_assumptions_bounded_by_one_and_all_rounds(tiny_sources, tmp_path, capsys):
    assert main(["generate", "--sources", str(tiny_sources), "--out", str(tmp_path / "run"), "--max-rounds", "1",
                 "-q"]) == 0  # the simulator: how many tasks generate really runs
    ran = json.loads((tmp_path / "run" / "medbanana-stats.json").read_text())["tasks"]
    capsys.readouterr()
    plan = _plan(capsys, "--sources", tiny_sources, "--backend", "gemini", "--max-rounds", "4")
    assert plan["tasks"] == ran == sum(k["tasks"] for k in plan["kinds"])
    assert plan["basis"] == "assumptions" and plan["assumptions"]["accept_rate_per_round"] == 0.5
    assert plan["calls"]["low"] == 3 * ran and plan["calls"]["high"] == 3 * 4 * ran
    assert plan["calls"]["low"] <= plan["calls"]["expected"] <= plan["calls"]["high"]
    usd, seconds = plan["usd"], plan["seconds"]
    assert 0 < usd["low"] < usd["expected"] < usd["high"] and usd["unpriced_models"] == []
    assert usd["expected"] == pytest.approx(sum(m["expected"] for m in usd["models"].values()))
    assert set(plan["tokens"]) == {"gemini-2.5-pro", "gemini-2.5-flash-image"}
    assert plan["tokens"]["gemini-2.5-pro"]["roles"] == ["writer", "judge"]
    assert 0 < seconds["low"] <= seconds["expected"] <= seconds["high"]
    (place,) = plan["destinations"]  # one host serves all three roles; the tiny sources carry no manifest
    assert place["where"] == "generativelanguage.googleapis.com" and place["class"] == "cloud"
    assert place["models"] == [{"model": "gemini-2.5-pro", "roles": ["writer", "judge"]},
                               {"model": "gemini-2.5-flash-image", "roles": ["editor"]}]
    assert place["data_use"] == ["unknown"] and "refused" not in place
    assert place["warnings"] and "unknown data use" in place["warnings"][0]
    assert main(["plan", "--sources", str(tiny_sources), "--backend", "gemini"]) == 0
    text = capsys.readouterr().out
    assert "ASSUMPTIONS (no --pilot)" in text and "MIMIC_tiny add Pneumothorax: 2" in text


def test_prices_rate_limits_and_models_without_a_price(tiny_sources, tmp_path, capsys):
    base = _plan(capsys, "--sources", tiny_sources, "--backend", "gemini")
    prices = tmp_path / "prices.json"
    doubled = {m: {"input_per_mtok": 2 * p.input_per_mtok, "output_per_mtok": 2 * p.output_per_mtok}
               for m, p in load_prices().models.items()}
    prices.write_text(json.dumps({"currency": "USD", "models": doubled}))
    dear = _plan(capsys, "--sources", tiny_sources, "--backend", "gemini", "--prices", prices)
    assert dear["usd"]["expected"] == pytest.approx(2 * base["usd"]["expected"])
    assert dear["usd"]["prices"]["override"] == str(prices)
    slow = _plan(capsys, "--sources", tiny_sources, "--backend", "gemini", "--rpm", "1")
    assert "--rpm 1 on gemini-2.5-pro" in slow["seconds"]["limited_by"]
    pro_calls = slow["calls"]["roles"]["writer"]["expected"] + slow["calls"]["roles"]["judge"]["expected"]
    assert slow["seconds"]["expected"] == pytest.approx(pro_calls * 60)
    unknown = _plan(capsys, "--sources", tiny_sources, "--backend", "gemini", "--editor-model", "gemini-9-image")
    assert unknown["usd"]["unpriced_models"] == ["gemini-9-image"]
    assert unknown["usd"]["expected"] < base["usd"]["expected"]  # the rest is priced; the unknown is not zero, named
    assert main(["plan", "--sources", str(tiny_sources), "--backend", "gemini", "--editor-model", "gemini-9-image"]) == 0
    assert "no price, give --prices FILE" in capsys.readouterr().out
    assert main(["plan", "--sources", str(tiny_sources), "--prices", str(tmp_path / "none.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err


@pytest.mark.slow
def test_a_pilot_run_gives_measured_figures_and_the_run_to_resume_leaves_its_tasks_out(tmp_path, capsys,
                                                                                       monkeypatch):
    sources = mimic_sources(tmp_path / "sources", "MIMIC_pilot", per_class=4)
    with FakeGemini(engine="echo", accept_rate=0.5) as fake:
        use_fake_gemini(monkeypatch, fake, "plan-test-key")
        assert main(["generate", "--sources", str(sources), "--out", str(tmp_path / "pilot"), "--backend", "gemini",
                     "--shard", "0/3", "--max-rounds", "3", "-q"]) == 0
    capsys.readouterr()
    pilot_tasks = json.loads((tmp_path / "pilot" / "medbanana-stats.json").read_text())["tasks"]
    plan = _plan(capsys, "--sources", sources, "--backend", "gemini", "--max-rounds", "3", "--pilot",
                 tmp_path / "pilot")
    assert plan["basis"] == "pilot" and plan["pilot"]["tasks"] == pilot_tasks
    assert plan["calls"]["low"] < plan["calls"]["expected"] < plan["calls"]["high"]
    per_task = plan["calls"]["expected"] / plan["tasks"]
    assert 3 <= per_task <= 9  # one to three rounds of three calls each
    rest = _plan(capsys, "--sources", sources, "--backend", "gemini", "--out", tmp_path / "pilot")
    assert rest["tasks"] == plan["tasks"] - pilot_tasks
    assert main(["plan", "--sources", str(sources), "--pilot", str(tmp_path / "sources")]) == 2
    assert "not a medbanana run directory" in capsys.readouterr().err


def _pilot(n: int) -> Pilot:
    """n tasks in the proportions 4:2:1:1 of one, two and three rounds (accepted) and three rejected rounds."""
    pattern = [1, 1, 1, 1, 2, 2, 3, 0]
    samples = []
    for i in range(n):
        rounds = pattern[i % len(pattern)]
        k = rounds or 3
        samples.append(TaskSample("add", k, (k, k, k), (2000 * k, 1400 * k, 3100 * k), (900 * k, 1300 * k, 1150 * k),
                                  40.0 * k, rounds > 0))
    return Pilot(Path("pilot"), samples, GEMINI, 3, (), {"success": n})


def test_the_interval_widens_when_the_pilot_is_small():
    tasks = [Task("D", "chest_xray", "Pneumothorax", "add", Path(f"n{i}.jpeg")) for i in range(1000)]
    setting = PlanSetting(GEMINI, load_prices(), max_rounds=3)
    widths = []
    for n in (8, 32, 128):
        plan = estimate(tasks, setting, _pilot(n), seed=1)
        expected, low, high = plan.figures["usd"]
        assert low < expected < high
        widths.append((high - low) / expected)
    assert widths[0] > widths[1] > widths[2]
    small = estimate(tasks, setting, _pilot(8), seed=1)
    assert any("8 finished tasks" in note for note in small.notes)


def test_plan_names_the_data_use_classes_each_destination_would_get_and_what_the_gate_would_refuse(tmp_path, capsys):
    """Credentialed sources (prepare --data-use credentialed) planned for the Gemini Developer API: the plan says
    the gate would refuse them; planned for the simulator, they stay local and nothing is refused."""
    folders = tmp_path / "folders" / "MIMIC_x"
    for name in ("a", "b"):
        write_jpeg(folders / "normal" / f"{name}.jpeg", size=256)
    write_jpeg(folders / "Pneumothorax" / "c.jpeg", size=256)
    assert main(["prepare", "folders", str(tmp_path / "folders"), "--out", str(tmp_path / "sources"),
                 "--data-use", "credentialed", "-q"]) == 0
    capsys.readouterr()
    (cloud,) = _plan(capsys, "--sources", tmp_path / "sources", "--backend", "gemini")["destinations"]
    assert cloud["class"] == "cloud" and cloud["data_use"] == ["credentialed"]
    assert "credentialed images (MIMIC_x)" in cloud["refused"]
    (local,) = _plan(capsys, "--sources", tmp_path / "sources", "--backend", "simulator")["destinations"]
    assert local["class"] == "local" and local["data_use"] == ["credentialed"] and "refused" not in local
    assert main(["plan", "--sources", str(tmp_path / "sources"), "--backend", "gemini"]) == 0
    assert "REFUSED: credentialed images" in capsys.readouterr().out
