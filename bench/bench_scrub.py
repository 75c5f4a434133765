"""Benchmark the scrubber (generation/secrets.py) on the texts it sees on every call.

    python bench/bench_scrub.py                  # a 1 MB Gemini answer (an edited image's base64), 2 secrets held
    python bench/bench_scrub.py --kb 4000 --secrets 4

Every generateContent answer passes through `holds_secret(body)` (twice: the body, then in scrub_response) and
every string field it holds (text and thought parts, finishMessage, modelVersion, ...) through `scrub`; every error
message through `scrub`. Prints microseconds per call of:
  * holds_secret on a clean body of --kb KB (the hot path: nearly every answer is clean);
  * scrub_response on the same answer parsed (the body's holds_secret plus a scrub of each string field: what every
    answer costs);
  * scrub on the same clean body (what an answer with a dirty text part costs);
  * scrub on a 2 KB error message quoting the headers (dirty: each secret once, raw);
  * scrub on a 2 KB error message holding the key as MIME-wrapped base64 and as HTML entities (dirty, encoded);
  * scrub on a 200-character clean instruction.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import time
import uuid


def _per_call_us(fn, arg, seconds: float = 1.0) -> float:
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn(arg)
        n += 1
    return elapsed / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kb", type=int, default=1000, help="size of the answer body")
    parser.add_argument("--secrets", type=int, default=2, help="secret values held (API keys, tokens)")
    args = parser.parse_args()
    names = ("GEMINI_API_KEY", "HF_TOKEN", "OPENAI_API_KEY", "GOOGLE_API_KEY", "HUGGING_FACE_HUB_TOKEN")
    keys = [f"AIza-bench-{uuid.uuid4()}" for _ in range(args.secrets)]
    for name in names:
        os.environ.pop(name, None)
    for name, key in zip(names, keys):
        os.environ[name] = key
    import textwrap

    from medbanana.generation.backends.gemini_transport import parse_response, scrub_response
    from medbanana.generation.secrets import holds_secret, scrub

    image = base64.b64encode(os.urandom(args.kb * 1024 * 3 // 4)).decode()
    body = json.dumps({"candidates": [{"content": {"role": "model", "parts": [
        {"text": "Here is the edited image."}, {"inlineData": {"mimeType": "image/jpeg", "data": image}}]},
        "finishReason": "STOP"}], "usageMetadata": {"promptTokenCount": 1290}})
    error = ("HTTP 500: " + json.dumps({"error": {"message": f"x-goog-api-key: {keys[0]} " + "detail " * 250}}))[:2048]
    wrapped = "\r\n".join(textwrap.wrap(base64.b64encode(f"headers: {keys[0]}".encode()).decode(), 76))
    encoded = (f"HTTP 500: {wrapped} {''.join(f'&#{ord(c)};' for c in keys[0])} " + "detail " * 250)[:2048]
    answer = parse_response(body)
    instruction = "Add a small right apical pneumothorax with a visible pleural line, no other change. " * 2
    assert not holds_secret(body) and scrub(body) is body and keys[0] not in scrub(error)
    assert scrub_response(answer, body)[1] is body and scrub(encoded).count("[redacted]") == 2
    print(f"{len(body) / 1e6:.2f} MB body, {len(keys)} secrets held")
    for what, fn, arg in (("holds_secret(clean body)", holds_secret, body),
                          ("scrub_response(clean answer)", lambda a: scrub_response(a, body), answer),
                          ("scrub(clean body)", scrub, body), ("scrub(2 KB dirty error)", scrub, error),
                          ("scrub(2 KB encoded error)", scrub, encoded), ("scrub(200 B instruction)", scrub, instruction)):
        print(f"{what:30s} {_per_call_us(fn, arg):10.1f} us")


if __name__ == "__main__":
    main()
