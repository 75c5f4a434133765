"""What calls cost: the shipped price table (prices.json: USD per million input and output tokens per model, long-
prompt tiers, the Batch discount, when and where the prices were read) and `--prices FILE` over it.

A model with no price is never priced at zero: `PriceTable.cost` answers None for it, and every report names it.
Backends that run on the user's own machine (the simulator, a diffusers editor) cost nothing per token.

    {"currency": "USD", "models": {"MODEL": {"input_per_mtok": X, "output_per_mtok": Y}}}

is the form of a `--prices` file (each model it names replaces the shipped entry; `long_prompt` and
`batch_discount` are taken as in prices.json).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .records import Usage
from .failures import UsageError

LOCAL_BACKENDS = frozenset({"simulator", "diffusers", "echo"})  # nothing billed per token
MAX_PRICE_FILE = 1 << 20  # bytes


@dataclass(frozen=True)
class ModelPrice:
    """USD per million tokens; output includes thinking tokens. Above `long_above` prompt tokens per call the
    long-prompt prices apply; with the Batch API `batch_discount` of the whole is taken off."""

    input_per_mtok: float
    output_per_mtok: float
    long_above: int | None = None
    long_input_per_mtok: float | None = None
    long_output_per_mtok: float | None = None
    batch_discount: float = 0.5

    def cost(self, input_tokens: float, output_tokens: float, *, calls: float = 1, batch: bool = False) -> float:
        """The price of `calls` calls that used these tokens together (the tier is chosen by the mean prompt)."""
        long = self.long_above is not None and calls > 0 and input_tokens / calls > self.long_above
        per_in = self.long_input_per_mtok if long and self.long_input_per_mtok is not None else self.input_per_mtok
        per_out = self.long_output_per_mtok if long and self.long_output_per_mtok is not None else self.output_per_mtok
        usd = (input_tokens * per_in + output_tokens * per_out) / 1e6
        return usd * (1 - self.batch_discount) if batch else usd


@dataclass(frozen=True)
class PriceTable:
    models: dict[str, ModelPrice]
    read_on: str = ""
    source: str = ""
    override: str | None = None  # the --prices file, when one was given
    overridden: tuple[str, ...] = field(default=())  # the models it priced

    def price_of(self, model: str) -> ModelPrice | None:
        return self.models.get(model.removeprefix("models/"))

    def cost(self, backend: str, model: str, usage: Usage | dict, *, calls: float = 1,
             batch: bool = False) -> float | None:
        """USD for this usage of `backend`'s `model`: 0 on the user's machine, None when the model has no price."""
        if backend in LOCAL_BACKENDS:
            return 0.0
        price = self.price_of(model)
        if price is None:
            return None
        tokens = usage if isinstance(usage, dict) else usage.__dict__
        output = tokens.get("output_tokens", 0) + tokens.get("thinking_tokens", 0)
        return price.cost(tokens.get("input_tokens", 0), output, calls=calls, batch=batch)

    def describe(self) -> dict:
        """Where the prices come from, as reports print it."""
        return {"read_on": self.read_on, "table": "medbanana/generation/prices.json (it names its sources)",
                "override": self.override, "overridden": list(self.overridden)}


def is_paid(backend: str) -> bool:
    """Whether calls of this backend go to a service that may bill them."""
    return backend not in LOCAL_BACKENDS


def load_prices(path: Path | str | None = None) -> PriceTable:
    """The shipped table, with the models of `path` (a --prices file) replacing the shipped entries; ValueError
    naming the file and the field for a file that is not of the form above."""
    shipped = json.loads((resources.files("medbanana.generation") / "prices.json").read_text(encoding="utf-8"))
    table = _models(shipped, "prices.json", 0.5)
    if path is None:
        return PriceTable(table, read_on=shipped.get("read_on", ""), source=shipped.get("source", ""))
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_PRICE_FILE + 1)
    except OSError as exc:
        raise UsageError(f"--prices {path}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > MAX_PRICE_FILE:
        raise UsageError(f"--prices {path}: larger than {MAX_PRICE_FILE // 1024} KiB; not a price table")
    try:
        given = json.loads(raw)
    except ValueError as exc:
        raise UsageError(f"--prices {path}: not JSON ({exc})") from None
    if not isinstance(given, dict) or not isinstance(given.get("models"), dict):
        raise UsageError(f'--prices {path}: want {{"currency": "USD", "models": {{"MODEL": {{"input_per_mtok": X, '
                         f'"output_per_mtok": Y}}}}}}')
    if given.get("currency", "USD") != "USD":
        raise UsageError(f"--prices {path}: currency {str(given['currency'])[:20]!r}: prices are in USD")
    mine = _models(given, f"--prices {path}", _fraction(given, "batch_discount", f"--prices {path}",
                                                         shipped.get("batch_discount", 0.5)))
    return PriceTable({**table, **mine}, read_on=shipped.get("read_on", ""), source=shipped.get("source", ""),
                      override=str(path), overridden=tuple(sorted(mine)))


def _models(raw: dict, where: str, default_discount: float) -> dict[str, ModelPrice]:
    default_discount = _fraction(raw, "batch_discount", where, default_discount)
    out = {}
    for name, entry in raw.get("models", {}).items():
        at = f"{where}: models.{str(name)[:80]}"
        if not isinstance(entry, dict):
            raise UsageError(f"{at}: want an object with input_per_mtok and output_per_mtok")
        long = entry.get("long_prompt")
        if long is not None and not isinstance(long, dict):
            raise UsageError(f"{at}.long_prompt: want an object with above_tokens, input_per_mtok, output_per_mtok")
        long = long or {}
        above = long.get("above_tokens")
        if long and (not isinstance(above, int) or isinstance(above, bool) or above < 1):
            raise UsageError(f"{at}.long_prompt.above_tokens: want a whole number of tokens, not {above!r}"[:300])
        out[str(name)] = ModelPrice(
            _amount(entry, "input_per_mtok", at), _amount(entry, "output_per_mtok", at), above if long else None,
            _amount(long, "input_per_mtok", f"{at}.long_prompt") if long else None,
            _amount(long, "output_per_mtok", f"{at}.long_prompt") if long else None,
            _fraction(entry, "batch_discount", at, default_discount))
    return out


def _amount(entry: dict, key: str, at: str) -> float:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e6:
        raise UsageError(f"{at}.{key}: want USD per million tokens (a number of at least 0), not {value!r}"[:300])
    return float(value)


def _fraction(entry: dict, key: str, at: str, default: float) -> float:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise UsageError(f"{at}.{key}: want a share between 0 and 1 (0.5: half price), not {value!r}"[:300])
    return float(value)
