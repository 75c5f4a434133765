"""Helpers of the review tests that talk to the real server over HTTP, as a hostile client would: gradio's queue API
called by hand (the routes the page itself calls), a tracker that records every request a page would make to
another host, and a review whose instructions are hostile markup (a samples file, as any evaluation folder)."""

from __future__ import annotations

import json
import threading
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class GradioSession:
    """One page session (a session hash) calling the page's events by the element id of the button that fires them,
    with the values the client chooses for every input: what a crafted client can send."""

    def __init__(self, url: str):
        self.url = url
        self.session = uuid.uuid4().hex[:11]
        with urllib.request.urlopen(f"{url}config", timeout=30) as response:
            config = json.load(response)
        self.components = {c["id"]: c for c in config["components"]}
        self.dependencies = config["dependencies"]

    def _elem(self, component_id: int) -> str:
        return self.components.get(component_id, {}).get("props", {}).get("elem_id") or ""  # 0: the page itself

    def event(self, elem_id: str) -> dict:
        """The dependency fired by the component with this elem_id."""
        for dep in self.dependencies:
            if any(self._elem(target) == elem_id for target, _event in dep["targets"]):
                return dep
        raise AssertionError(f"no event on #{elem_id}")

    def call(self, elem_id: str, values: dict) -> dict:
        """Fire the event of `elem_id` with {input elem_id or component type: value}; {output elem_id: value}.
        Inputs not named are sent as null (gr.State inputs are the server's, whatever is sent)."""
        dep = self.event(elem_id)
        data = [values.get(self._elem(i), values.get(self.components[i]["type"])) for i in dep["inputs"]]
        body = json.dumps({"data": data, "fn_index": dep["id"], "session_hash": self.session, "event_data": None,
                           "trigger_id": None}).encode()
        request = urllib.request.Request(f"{self.url}gradio_api/queue/join", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"{self.url}gradio_api/queue/data?session_hash={self.session}",
                                    timeout=60) as stream:
            for line in stream:
                if not line.startswith(b"data:"):
                    continue
                message = json.loads(line[5:])
                if message.get("msg") == "process_completed":
                    assert message.get("success"), message
                    outputs = message["output"]["data"]
                    return {self._elem(o) or f"#{o}": value for o, value in zip(dep["outputs"], outputs)}
        raise AssertionError("the event did not complete")


def value_of(output) -> str:
    """A component's new value in an event's output (a bare value, or an update dict)."""
    return output.get("value", "") if isinstance(output, dict) else (output or "")


class Tracker:
    """An HTTP server on 127.0.0.1 that records every request (a page must make none to it)."""

    def __init__(self):
        requests = self.requests = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                requests.append(self.path)
                self.send_response(204)
                self.end_headers()

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def hostile_instructions(tracker: str) -> list[str]:
    """Instructions holding every kind of markup that would fetch, link or add page structure if rendered."""
    return [f"Add a small effusion. <img src={tracker}/img.png> <form action={tracker}/form><button>Go</button></form>"
            f" <details open><summary>more</summary>hidden</details> <svg><image href='{tracker}/svg.png'/></svg>"
            f" <video src={tracker}/video.mp4 autoplay></video> <iframe src={tracker}/frame></iframe>",
            f"Remove the opacity. ![x]({tracker}/md.png) [click here]({tracker}/link) **bold** `code`"
            f" <script>fetch('{tracker}/script')</script> <a href={tracker}/a>a link</a> $x^2$"]


def write_samples(folder: Path, instructions: list[str]) -> Path:
    """An evaluation folder (samples.jsonl + PNGs) whose edits carry `instructions`."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with (folder / "samples.jsonl").open("w", encoding="utf-8") as out:
        for n, text in enumerate(instructions):
            for name in ("source", "edited"):
                Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"{name}{n}.png")
            out.write(json.dumps({"id": f"case-{n}", "source": f"source{n}.png", "edited": f"edited{n}.png",
                                  "instruction": text, "disease": "Pleural_Effusion", "modality": "chest_xray",
                                  "direction": "add" if n % 2 == 0 else "remove"}) + "\n")
    return folder
