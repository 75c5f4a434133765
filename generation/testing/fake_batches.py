"""The fake Gemini server's Batch API and Files API: jobs are answered by the fake's own generateContent.

    POST /{v1,v1beta}/models/{model}:batchGenerateContent   create (inline requests, or a JSONL file's name)
    GET  /{v1,v1beta}/batches/{id}                          poll: state, and the results once it succeeded
    POST /upload/{v1,v1beta}/files                          resumable upload: start, then chunks to ?upload_id=N
    GET  /{v1,v1beta}/files/{id}:download                   a results file (JSONL of {"key", "response"|"error"})

A job runs in a background thread, request by request, through `FakeGemini.generate_content` (same roles, faults
and engine; no per-call latency). It reports RUNNING until its work is done and `seconds` have passed, and while
it is held (`hold(first=k)` holds the k-th job created and every later one until `release()`), which lets a test
stop a client in the middle of a batch. `garble(how)` makes status answers malformed, as a broken proxy or an
incompatible endpoint might: "json" (a torn body), "state" (a state the API does not have), "fields" (no
metadata: no state at all), "output" (SUCCEEDED without its results). `tear_downloads(first=k)` cuts the next k
results files in the middle of their last line, as a transfer cut short behind a proxy would.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

_STATE = {"running": "BATCH_STATE_RUNNING", "succeeded": "BATCH_STATE_SUCCEEDED", "failed": "BATCH_STATE_FAILED"}
GARBLES = ("json", "state", "fields", "output")


@dataclass
class FakeJob:
    number: int  # 1 for the first job this server created
    name: str
    model: str
    display_name: str
    items: list[tuple[dict, dict]]  # (metadata or {"key": ...}, generateContent request body)
    from_file: bool
    created: float = field(default_factory=time.monotonic)
    outcome: str = ""  # "" while running, then "succeeded" or "failed"
    output: dict = field(default_factory=dict)


class FakeBatches:
    def __init__(self, fake, seconds: float = 0.0):
        self.fake = fake
        self.seconds = seconds
        self.jobs: dict[str, FakeJob] = {}
        self.files: dict[str, bytes] = {}
        self._uploads: dict[str, dict] = {}
        self.polls: Counter = Counter()  # job name -> GET requests seen
        self._upload_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._hold_from: int | None = None
        self._garble: str = ""
        self._garble_left: int | None = None  # polls still to garble; None: every one
        self._tear_left = 0  # results file downloads still to cut short

    def hold(self, first: int = 1) -> None:
        """Keep the `first`-th job created (counting from 1) and every later one RUNNING until `release()`;
        their work still gets done."""
        self._hold_from = first

    def release(self) -> None:
        self._hold_from = None

    def garble(self, how: str, first: int | None = None) -> None:
        """Answer the next `first` status polls (default: every one) malformed, in one of the GARBLES ways."""
        if how not in GARBLES:
            raise ValueError(f"garble must be one of {', '.join(GARBLES)}, not {how!r}")
        self._garble, self._garble_left = how, first

    def tear_downloads(self, first: int) -> None:
        """Answer the next `first` results file downloads torn: cut in the middle of their last line."""
        self._tear_left = first

    def created(self) -> list[FakeJob]:
        with self._lock:
            return list(self.jobs.values())

    # ------------------------------------------------------------ jobs

    def create(self, model: str, request: dict, api_key: str, **_) -> tuple[int, dict, dict]:
        batch = request.get("batch") or {}
        source = batch.get("inputConfig") or batch.get("input_config") or {}
        if "requests" in source:
            items = [(entry.get("metadata") or {}, entry.get("request") or {})
                     for entry in (source["requests"] or {}).get("requests") or []]
        elif source.get("fileName") in self.files:
            lines = self.files[source["fileName"]].decode().splitlines()
            items = [({"key": line["key"]}, line["request"]) for line in map(json.loads, filter(None, lines))]
        else:
            return self.fake.error(400, f"batch input must be inline requests or an uploaded file: {source}")
        if not items:
            return self.fake.error(400, "a batch needs at least one request")
        with self._lock:
            number = len(self.jobs) + 1
            name = f"batches/fake-{number}"
            job = FakeJob(number, name, model, batch.get("displayName", ""), items, "fileName" in source)
            self.jobs[name] = job
        threading.Thread(target=self._work, args=(job, api_key), name=f"fake-{name}", daemon=True).start()
        return 200, self._describe(job), {}

    def get(self, batch_id: str, **_) -> tuple[int, dict | bytes, dict]:
        job = self.jobs.get(f"batches/{batch_id}")
        if job is None:
            return self.fake.error(404, f"no batch batches/{batch_id}")
        with self._lock:
            self.polls[job.name] += 1
            how = self._garble if self._garble_left is None or self._garble_left > 0 else ""
            if how and self._garble_left is not None:
                self._garble_left -= 1
        answer = self._describe(job)
        if how == "json":
            return 200, json.dumps(answer).encode()[:40], {"Content-Type": "application/json"}
        if how == "state":
            answer["metadata"]["state"] = "BATCH_STATE_WIBBLING"
        elif how == "fields":
            answer = {"name": job.name}
        elif how == "output":
            answer["metadata"].update(state=_STATE["succeeded"])
            answer["metadata"].pop("output", None)
            answer["done"] = True
        return 200, answer, {}

    def _describe(self, job: FakeJob) -> dict:
        held = self._hold_from is not None and job.number >= self._hold_from
        done = job.outcome and not held and time.monotonic() - job.created >= self.seconds
        metadata = {"@type": "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatch",
                    "model": f"models/{job.model}", "displayName": job.display_name,
                    "state": _STATE[job.outcome if done else "running"],
                    "batchStats": {"requestCount": str(len(job.items))}}
        if done and job.outcome == "succeeded":
            metadata["output"] = job.output
        return {"name": job.name, "metadata": metadata, "done": bool(done)}

    def _work(self, job: FakeJob, api_key: str) -> None:
        role = self.fake.role_of(job.items[0][1])
        if self.fake.strike("batch_failed", role):
            job.outcome = "failed"
            return
        results = []
        for metadata, request in job.items:
            status, body, _ = self.fake.generate_content(job.model, request, api_key, in_batch=job.name)
            results.append((metadata, {"response": body} if status == 200 else body))
        if job.from_file:
            lines = [json.dumps({"key": meta.get("key"), **result}) for meta, result in results]
            output_file = f"files/{job.name.split('/')[-1]}-results"
            self.files[output_file] = ("\n".join(lines) + "\n").encode()
            job.output = {"responsesFile": output_file}
        else:
            job.output = {"inlinedResponses": {"inlinedResponses": [{**result, "metadata": meta}
                                                                    for meta, result in results]}}
        job.outcome = "succeeded"

    # ------------------------------------------------------------ files

    def upload(self, request: bytes, headers, query: dict, **_) -> tuple[int, dict, dict]:
        command = headers.get("X-Goog-Upload-Command", "")
        if command == "start":
            upload_id = str(next(self._upload_ids))
            meta = (json.loads(request or b"{}").get("file") or {})
            self._uploads[upload_id] = {"data": bytearray(), "mimeType": meta.get("mime_type", meta.get("mimeType"))}
            url = f"{self.fake.base_url}/upload/v1beta/files?upload_id={upload_id}"
            return 200, {}, {"X-Goog-Upload-URL": url, "X-Goog-Upload-Status": "active"}
        upload = self._uploads.get(query.get("upload_id", ""))
        if upload is None or "upload" not in command:
            return self.fake.error(400, f"unknown upload or command {command!r}")
        if int(headers.get("X-Goog-Upload-Offset", "0")) != len(upload["data"]):
            return self.fake.error(400, "upload offset does not match the bytes received")
        upload["data"] += request
        if "finalize" not in command:
            return 200, {}, {"X-Goog-Upload-Status": "active"}
        name = f"files/upload-{query['upload_id']}"
        self.files[name] = bytes(self._uploads.pop(query["upload_id"])["data"])
        file = {"name": name, "mimeType": upload["mimeType"], "sizeBytes": str(len(self.files[name])),
                "state": "ACTIVE"}
        return 200, {"file": file}, {"X-Goog-Upload-Status": "final"}

    def download(self, file_id: str, **_) -> tuple[int, bytes | dict, dict]:
        data = self.files.get(f"files/{file_id}")
        if data is None:
            return self.fake.error(404, f"no file files/{file_id}")
        with self._lock:
            torn, self._tear_left = self._tear_left > 0, max(0, self._tear_left - 1)
        if torn:
            data = data[:len(data) - len(data.rstrip(b"\n").rsplit(b"\n", 1)[-1]) // 2 - 1]
        return 200, data, {}
