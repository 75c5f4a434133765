"""Prices are data: the shipped table, a --prices file over it, and a model without a price named, never free."""

import json

import pytest

from medbanana.generation.costs import Tally, cost_lines, cost_report
from medbanana.generation.pricing import load_prices
from medbanana.generation.records import Usage


def test_the_shipped_table_prices_the_papers_models_and_says_when_and_where_it_was_read():
    table = load_prices()
    assert table.read_on and table.source.startswith("Gemini Developer API pricing")
    for model in ("gemini-2.5-pro", "gemini-2.5-flash-image", "gemini-3.1-flash-image-preview", "gemini-3.5-flash"):
        assert table.price_of(model) is not None, model
    # an output image of 1,290 tokens from the paper's editor: the page's 0.039 USD
    assert table.cost("gemini", "gemini-2.5-flash-image", Usage(0, 1290)) == pytest.approx(0.0387)
    assert table.cost("gemini", "models/gemini-2.5-pro", Usage(0, 0, 1_000_000)) == pytest.approx(10.0)  # thinking
    assert table.cost("gemini", "gemini-2.5-pro", Usage(100_000, 0), batch=True) == pytest.approx(0.0625)


def test_a_long_prompt_is_priced_at_its_tier_per_call():
    table = load_prices()
    short = table.cost("gemini", "gemini-2.5-pro", {"input_tokens": 300_000}, calls=2)  # 150k a call
    long = table.cost("gemini", "gemini-2.5-pro", {"input_tokens": 300_000}, calls=1)
    assert short == pytest.approx(0.375) and long == pytest.approx(0.75)


def test_a_model_without_a_price_is_named_and_a_local_backend_costs_nothing():
    table = load_prices()
    assert table.cost("gemini", "gemini-9-ultra", Usage(10, 10)) is None
    assert table.cost("simulator", "anything", Usage(10**6, 10**6)) == 0.0
    tally = Tally()
    tally.add_round({"usage": {"writer": {"input_tokens": 1000, "output_tokens": 100},
                               "editor": {"input_tokens": 500, "output_tokens": 1290}}, "edit_result": {}})
    report = cost_report(tally, {"writer": {"backend": "gemini", "model": "gemini-9-ultra"},
                                 "editor": {"backend": "gemini", "model": "gemini-2.5-flash-image"},
                                 "judge": {"backend": "gemini", "model": "gemini-2.5-pro"}}, table)
    assert report.unpriced == ["gemini-9-ultra"]
    assert report.usd == pytest.approx((500 * 0.3 + 1290 * 30) / 1e6)
    assert "the calls of gemini-9-ultra (no price" in cost_lines(report.as_dict())[-1]


def test_a_prices_file_replaces_the_models_it_names(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"currency": "USD", "models": {
        "gemini-2.5-pro": {"input_per_mtok": 2, "output_per_mtok": 20},
        "my-vllm-model": {"input_per_mtok": 0, "output_per_mtok": 0}}}))
    table = load_prices(path)
    assert table.cost("gemini", "gemini-2.5-pro", Usage(100_000, 100_000)) == pytest.approx(2.2)
    assert table.cost("openai", "my-vllm-model", Usage(5, 5)) == 0.0
    assert table.price_of("gemini-2.5-flash-image") is not None  # the rest stays shipped
    assert table.describe()["overridden"] == ["gemini-2.5-pro", "my-vllm-model"]


@pytest.mark.parametrize("content, field", [
    ("not json", "not JSON"),
    ('{"models": []}', '"currency": "USD"'),
    ('{"currency": "EUR", "models": {}}', "prices are in USD"),
    ('{"models": {"m": {"input_per_mtok": -1, "output_per_mtok": 1}}}', "models.m.input_per_mtok"),
    ('{"models": {"m": {"input_per_mtok": 1, "output_per_mtok": "cheap"}}}', "models.m.output_per_mtok"),
    ('{"models": {"m": {"input_per_mtok": 1, "output_per_mtok": 1, "batch_discount": 2}}}', "batch_discount"),
    ('{"models": {"m": {"input_per_mtok": 1, "output_per_mtok": 1, "long_prompt": {"above_tokens": 0}}}}',
     "long_prompt.above_tokens"),
])
def test_a_bad_prices_file_is_one_line_naming_the_field(tmp_path, content, field):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ValueError) as error:
        load_prices(path)
    assert field in str(error.value) and "\n" not in str(error.value) and str(path) in str(error.value)
