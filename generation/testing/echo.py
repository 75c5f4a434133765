"""A cheap engine for the fake Gemini server (`--engine echo`), for throughput benchmarks: no image processing.

The writer numbers its attempts, the editor returns the source bytes unchanged (a valid JPEG of the source's
size), and the judge accepts when a hash of the original image and the instruction falls under `accept_rate`,
so tasks take a realistic, deterministic number of rounds. The fake server calls the sync halves (`instruction`,
`verdict`) and sends the editor's request image back as it came (fake_gemini.py), so it decodes no base64 and
spends only its HTTP and JSON work per call (about a millisecond for 1024^2 images). The simulator engine (the
default) does real edits and measurements, at ~0.1-0.2 s of CPU each.
"""

from __future__ import annotations

import hashlib

from ..backends import Editor, InstructionWriter, Judge
from ..records import Attempt, EditedImage, Instruction, SourceImage, Task, Verdict, rubric_score

_FAILABLE = ("has_disease", "structure_reasonable", "looks_realistic", "fidelity_preserved")


class EchoWriter(InstructionWriter):
    name = "echo"

    async def write(self, task: Task, source: SourceImage, history: list[Attempt]) -> Instruction:
        return self.instruction(task, history)

    def instruction(self, task: Task, history: list[Attempt]) -> Instruction:
        """The instruction, without the source (the fake server calls this directly, with no event loop)."""
        verb = "Add" if task.direction == "add" else "Remove"
        return Instruction(text=f"{verb} {task.disease.replace('_', ' ')} with the smallest visible change and "
                                f"keep everything else unchanged (attempt {len(history) + 1}).",
                           thinking_summary=f"Attempt {len(history) + 1} after {len(history)} earlier round(s).")


class EchoEditor(Editor):
    name = "echo"

    async def edit(self, task: Task, source: SourceImage, instruction: str, seed: int) -> EditedImage:
        return EditedImage(data=source.data)


class EchoJudge(Judge):
    name = "echo"

    def __init__(self, accept_rate: float = 0.6):
        self.accept_rate = accept_rate

    async def judge(self, task: Task, source: SourceImage, edited: EditedImage, instruction: str) -> Verdict:
        return self.verdict(task, source.sha256.encode(), instruction)

    def verdict(self, task: Task, original: bytes, instruction: str) -> Verdict:
        """The verdict from `original`, bytes that tell the original image apart (its sha256 in `judge`; the fake
        server passes the base64 text it received, so it needs no decode), and the instruction."""
        hashed = hashlib.sha256(original)
        hashed.update(instruction.encode())
        digest = hashed.digest()
        accepted = int.from_bytes(digest[:4], "little") / 2**32 < self.accept_rate
        passed = dict.fromkeys(_FAILABLE, True)
        if not accepted:
            passed[_FAILABLE[digest[4] % len(_FAILABLE)]] = False
        has_disease = passed["has_disease"] == (task.direction == "add")
        reason = "All criteria met." if accepted else f"{[k for k, v in passed.items() if not v][0]} failed."
        return Verdict(has_disease=has_disease, structure_reasonable=passed["structure_reasonable"],
                       looks_realistic=passed["looks_realistic"], fidelity_preserved=passed["fidelity_preserved"],
                       qualified=accepted, reason=reason,
                       score=rubric_score(*(passed[k] for k in _FAILABLE)), thinking_summary="Compared both images.")
