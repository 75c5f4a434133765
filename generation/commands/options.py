"""Options `generate` and `plan` share, defined once: the value types argparse checks them with, the task selection,
the choice of backends and models, rate limits, and prices."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..destinations import ZERO_RETENTION
from ..taxonomy import DIRECTIONS, load_taxonomy


def shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard wants i/N, e.g. 0/4, not {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= i < N")
    return index, count


def whole_number(text: str, minimum: int = 1, auto: bool = False) -> int | str:
    """A whole number of at least `minimum`, or also 'auto' (`--workers`): argparse adds the option's name."""
    if auto and text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"want a whole number of at least {minimum}{' or auto' if auto else ''}, "
                                         f"not {text!r}")
    return value


def count(text: str) -> int | str:
    return whole_number(text)


def workers(text: str) -> int | str:
    """`--workers N|auto`."""
    return whole_number(text, auto=True)


def positive(text: str) -> float:
    """A number above 0 (seconds, rates, USD): argparse adds the option's name."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"want a number above 0, not {text!r}")
    return value


def add_selection_options(p: argparse.ArgumentParser) -> None:
    """--sources and what part of them: modality, modalities, diseases, directions, limit, shard."""
    p.add_argument("--sources", type=Path, help="folder of dataset folders, or one dataset folder")
    p.add_argument("--modality", choices=sorted(load_taxonomy().modalities),
                   help="modality of the dataset folders when their names do not tell")
    p.add_argument("--modalities", nargs="+", metavar="M", help="only these modalities")
    p.add_argument("--diseases", nargs="+", metavar="D", help="only these diseases (folder or display names)")
    p.add_argument("--directions", nargs="+", choices=DIRECTIONS, help="only these directions (default both)")
    p.add_argument("--limit", type=count, help="only the first N tasks (for a quick try)")
    p.add_argument("--shard", type=shard, metavar="i/N", help="take the i-th of N deterministic parts of the tasks")


def add_backend_choice(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", help="backend for all roles: simulator (offline, the default) or gemini (paid: "
                                     "calls Gemini with GEMINI_API_KEY/GOOGLE_API_KEY; never chosen unless named)")
    p.add_argument("--writer", help="backend name for the instruction writer (overrides --backend)")
    p.add_argument("--editor", help="backend name for the editor (overrides --backend)")
    p.add_argument("--judge", help="backend name for the judge (overrides --backend)")


def add_model_options(g) -> None:
    g.add_argument("--editor-model", help="editor model id (gemini: default gemini-2.5-flash-image; diffusers: a "
                                          "local folder or Hugging Face id, required)")
    g.add_argument("--writer-model", help="instruction writer model id (default gemini-2.5-pro)")
    g.add_argument("--judge-model", help="judge model id (default gemini-2.5-pro)")


def add_rate_limits(g) -> None:
    g.add_argument("--rpm", type=positive, help="client-side limit of requests per minute per model (default: none)")
    g.add_argument("--tpm", type=positive, help="client-side limit of tokens per minute per model, from the usage "
                                            "each answer reports (default: none)")


def add_prices_option(p) -> None:
    p.add_argument("--prices", type=Path, metavar="FILE",
                   help='prices to use over the shipped table (generation/prices.json), JSON: {"currency": "USD", '
                        '"models": {"MODEL": {"input_per_mtok": X, "output_per_mtok": Y}}}, USD per million tokens')


def add_vertex_options(g) -> None:
    """Gemini on Vertex AI: where its requests go (generate's, and plan's for the destinations it lists)."""
    g.add_argument("--vertex", action="store_true",
                   help="call Gemini on Vertex AI (same models, your Google Cloud project; Application Default "
                        "Credentials, or an API key in express mode); GOOGLE_GENAI_USE_VERTEXAI=true does the same")
    g.add_argument("--vertex-project", metavar="PROJECT", help="Vertex AI project (default GOOGLE_CLOUD_PROJECT)")
    g.add_argument("--vertex-location", metavar="LOCATION",
                   help="Vertex AI location, e.g. us-central1 (default GOOGLE_CLOUD_LOCATION, else global)")


def add_openai_endpoint_options(g) -> None:
    """An OpenAI-compatible server: where its requests go, whether its user attests it keeps no data, its model."""
    g.add_argument("--openai-base-url", metavar="URL",
                   help="chat-completions server, e.g. http://localhost:8000/v1 (default: OPENAI_BASE_URL, else "
                        "api.openai.com)")
    g.add_argument("--attest-endpoint", choices=(ZERO_RETENTION,),
                   help="you attest that the remote OpenAI-compatible endpoint (--openai-base-url) keeps no data, "
                        "trains on none and lets no human review it: its destination class becomes "
                        "cloud-no-retention, which credentialed sources may go to (recorded in the run; "
                        "docs/data-destinations.md)")
    g.add_argument("--openai-model", metavar="NAME", help="model name as the server knows it, for writer and judge "
                                                          "(--writer-model / --judge-model override per role)")
