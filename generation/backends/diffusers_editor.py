"""The `diffusers` editor: an instruction-guided editing pipeline (InstructPix2Pix-style) on your own GPU.

The pipeline class is chosen from the model's `model_index.json` (DiffusionPipeline.from_pretrained) and must be
one that edits an image by an instruction (INSTRUCTION_PIPELINES). Concurrent `edit` calls are gathered into
batches of up to `batch_size` images that run as one pipeline call, one batch at a time on the device.

Resize policy: the source is resized (Lanczos) so that its longer side is `resolution` pixels, both sides rounded
down to a multiple of 8 (the VAE's stride); the edit is resized back to the source's own size (a 1024² source
gives a 1024² edit) and stored as JPEG q95. The instruction is the prompt as it is (CLIP reads its first 77
tokens). The safety checker is not loaded: it blanks medical images as false positives.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..extras import require
from .base import APIError, Editor
from ..records import EditedImage, SourceImage, Task, encode_jpeg
from ..failures import NotFound, UsageError

INSTRUCTION_PIPELINES = ("StableDiffusionInstructPix2PixPipeline", "StableDiffusionXLInstructPix2PixPipeline")
DTYPES = ("auto", "float16", "bfloat16", "float32")


def _import_torch_diffusers():
    return require("torch", "diffusers", needed_for="the diffusers editor", extra="train")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def resolve_device(device: str = "auto") -> str:
    torch, _ = _import_torch_diffusers()
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str):
    """"auto": float16 on a GPU, float32 on the CPU (half precision is slow or unsupported there)."""
    torch, _ = _import_torch_diffusers()
    if dtype not in DTYPES:
        raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "float16"
    return getattr(torch, dtype)


def load_pipeline(model: str, dtype, *, revision: str | None = None, trust_remote_code: bool = False,
                  **components):
    """DiffusionPipeline.from_pretrained from a local folder, or a hub id (from the cache when HF_HUB_OFFLINE is
    set); FileNotFoundError naming the id and the offline setting when it is not there. `components` replace the
    pipeline's own (e.g. `unet=` a trained UNet)."""
    _, diffusers = _import_torch_diffusers()
    local = Path(model).expanduser()
    offline = hub_offline()
    # diffusers renamed torch_dtype to dtype (the old name is deprecated); the pipeline module tells which it reads
    dtype_key = "dtype" if hasattr(diffusers.pipelines.pipeline_utils, "_resolve_dtype") else "torch_dtype"
    options = {"safety_checker": None, dtype_key: dtype, "revision": revision,
               "trust_remote_code": trust_remote_code, **components}
    if local.is_dir():  # a folder's own errors (a broken model_index.json, ...) are reported as they are
        return diffusers.DiffusionPipeline.from_pretrained(str(local), local_files_only=True, **options)
    try:
        return diffusers.DiffusionPipeline.from_pretrained(model, local_files_only=offline, **options)
    except (OSError, ValueError) as exc:  # hub errors are OSErrors; a malformed id is a ValueError
        where = ("HF_HUB_OFFLINE is set, so only the local Hugging Face cache was searched" if offline else
                 "it could not be downloaded either")
        raise NotFound(
            f"diffusers model {model!r} is not present locally: it is not a folder, and {where}. Download it "
            f"first (`hf download {model}`) on a machine with access, or pass a local folder; with "
            f"HF_HUB_OFFLINE=1 runs never reach the network. ({type(exc).__name__}: {str(exc)[:300]})") from None


def working_size(width: int, height: int, resolution: int) -> tuple[int, int]:
    """(w, h) with the longer side `resolution` and the aspect kept, both multiples of 8.

    >>> working_size(1024, 1024, 512), working_size(1024, 768, 512)
    ((512, 512), (512, 384))
    """
    scale = resolution / max(width, height)
    return max(8, int(width * scale) // 8 * 8), max(8, int(height * scale) // 8 * 8)


@dataclass
class _Job:
    task: Task
    source: SourceImage
    instruction: str
    seed: int
    size: tuple[int, int]
    future: asyncio.Future


class DiffusersEditor(Editor):
    """Edits with a local diffusers pipeline; `pipeline` may be passed ready-made (tests), else `model` is loaded."""

    name = "diffusers"

    def __init__(self, *, model: str | None = None, pipeline=None, steps: int = 20, guidance_scale: float = 7.5,
                 image_guidance_scale: float = 1.5, resolution: int = 512, dtype: str = "auto",
                 device: str = "auto", batch_size: int = 4, batch_wait: float = 0.05, attention: bool = False,
                 attention_dir: str | Path | None = None):
        self.torch, _ = _import_torch_diffusers()
        if pipeline is None and not model:
            raise UsageError("the diffusers editor needs --editor-model: a local folder or a Hugging Face id")
        if steps < 1 or batch_size < 1 or resolution < 8:
            raise UsageError("steps and batch_size must be at least 1, resolution at least 8")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        pipeline = pipeline if pipeline is not None else load_pipeline(model, self.dtype)
        kind = type(pipeline).__name__
        if kind not in INSTRUCTION_PIPELINES:
            raise UsageError(f"{model or kind}: a {kind} does not edit by instruction; the diffusers editor takes "
                             f"{', '.join(INSTRUCTION_PIPELINES)}")
        self.pipeline = pipeline.to(self.device, self.dtype)
        self.pipeline.set_progress_bar_config(disable=True)
        self.model = model or getattr(pipeline.config, "_name_or_path", "") or kind
        self.steps, self.guidance_scale, self.image_guidance_scale = steps, guidance_scale, image_guidance_scale
        self.resolution, self.batch_size, self.batch_wait = resolution, batch_size, batch_wait
        # attention-grounding diagnostics (attention.py): IoU with the region of interest in each edit's details
        self.attention = attention or attention_dir is not None
        self.attention_dir = Path(attention_dir) if attention_dir else None
        self._batches: set[asyncio.Future] = set()  # the loop keeps only weak references to tasks
        self._pending: list[_Job] = []
        self._timer: asyncio.TimerHandle | None = None
        self._device_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusers")  # one batch at a time
        self.batches_run = 0

    async def edit(self, task: Task, source: SourceImage, instruction: str, seed: int) -> EditedImage:
        loop = asyncio.get_running_loop()
        height, width = source.array.shape[:2]
        job = _Job(task, source, instruction.strip(), int(seed) % 2**63, working_size(width, height, self.resolution),
                   loop.create_future())
        self._pending.append(job)
        if sum(1 for j in self._pending if j.size == job.size) >= self.batch_size:
            self._flush()
        elif self._timer is None:  # wait briefly for the other tasks in flight to ask too
            self._timer = loop.call_later(self.batch_wait, self._flush)
        return await job.future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        groups: dict[tuple[int, int], list[_Job]] = {}
        for job in pending:
            groups.setdefault(job.size, []).append(job)
        for jobs in groups.values():
            for start in range(0, len(jobs), self.batch_size):
                batch = asyncio.ensure_future(self._run_batch(jobs[start:start + self.batch_size]))
                self._batches.add(batch)
                batch.add_done_callback(self._batches.discard)

    async def _run_batch(self, jobs: list[_Job]) -> None:
        loop = asyncio.get_running_loop()
        try:
            images, maps = await loop.run_in_executor(self._device_thread, self._infer, jobs)
        except Exception as exc:  # the whole batch failed: each task records it and can be retried
            oom = "out of memory" in str(exc).lower()
            error = APIError("out_of_memory" if oom else "pipeline_error",
                             f"{self.model}: {type(exc).__name__}: {str(exc)[:400]}"
                             + (" (lower --diffusers-batch-size or --diffusers-resolution)" if oom else ""))
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(error)
            return
        for job, image, latent_map in zip(jobs, images, maps):
            try:  # resizing, JPEG and attention diagnostics off the event loop
                edited = await asyncio.to_thread(self._edited, job, image, len(jobs), latent_map)
            except Exception as exc:  # a failure here must still answer the waiting task
                edited = APIError("pipeline_error", f"{self.model}: after the edit: {type(exc).__name__}: {exc}")
            if job.future.done():
                continue
            if isinstance(edited, APIError):
                job.future.set_exception(edited)
            else:
                job.future.set_result(edited)

    def _infer(self, jobs: list[_Job]) -> tuple[list, list]:
        """One pipeline call for a batch of same-size jobs (runs in the device thread): (images, attention maps at
        the latent grid, None each when not recorded)."""
        from contextlib import nullcontext

        from PIL import Image

        from . import attention

        torch = self.torch
        recorder = None
        if self.attention:
            scale = self.pipeline.vae_scale_factor
            positions = [attention.token_positions(self.pipeline.tokenizer, j.instruction,
                                                   attention.disease_words(j.task.disease, j.task.modality))
                         for j in jobs]
            recorder = attention.CrossAttentionRecorder(positions, (jobs[0].size[1] // scale, jobs[0].size[0] // scale))
        images = [Image.fromarray(j.source.array).resize(j.size, Image.LANCZOS) for j in jobs]
        # CPU generators: the same seed gives the same noise on any device
        generators = [torch.Generator("cpu").manual_seed(j.seed) for j in jobs]
        with torch.inference_mode(), (attention.recording(self.pipeline.unet, recorder) if recorder else nullcontext()):
            out = self.pipeline(prompt=[j.instruction for j in jobs], image=images,
                                num_inference_steps=self.steps, guidance_scale=self.guidance_scale,
                                image_guidance_scale=self.image_guidance_scale, generator=generators,
                                output_type="pil")
        self.batches_run += 1
        return out.images, recorder.maps() if recorder else [None] * len(jobs)

    def _truncated(self, instruction: str) -> bool:
        """Whether the text encoder saw only the start of the instruction (CLIP reads 77 tokens)."""
        tokenizer = self.pipeline.tokenizer
        return len(tokenizer(instruction).input_ids) > tokenizer.model_max_length

    def _grounding(self, job: _Job, latent_map) -> dict:
        """The attention diagnostics of one edit, for its details (and its overlay PNG when asked for): the
        thresholded attention mask at the source's size (`mask`, raster.encode_mask), for `eval --attention` to
        score against the dataset's edit_mask, and its IoU now with the task's grown region (`iou`, `roi`)."""
        from ..raster import encode_mask
        from . import attention

        if latent_map is None:
            return {"iou": None, "reason": "no disease word of the instruction reached the text encoder"}
        height, width = job.source.array.shape[:2]
        heat = attention.heat_map(latent_map, (width, height))
        mask = attention.attention_mask(heat)
        roi = attention.region_mask(job.source.array, job.task.modality, job.task.disease)
        value = attention.iou(mask, roi)
        out = {"iou": round(value, 4), "roi": "region", "mislocalised": value < attention.MISLOCALISED_BELOW,
               "otsu_factor": attention.OTSU_FACTOR, attention.MASK_KEY: encode_mask(mask)}
        if self.attention_dir is not None:
            name = f"{job.task.uid.replace('/', '_')}-seed{job.seed}.png"
            out["overlay"] = str(attention.save_overlay(self.attention_dir / name, job.source.array, heat, roi))
        return out

    def _edited(self, job: _Job, image, batch_size: int, latent_map=None) -> EditedImage:
        from PIL import Image

        height, width = job.source.array.shape[:2]
        array = np.asarray(image.convert("RGB").resize((width, height), Image.LANCZOS))
        extra = {"attention": self._grounding(job, latent_map)} if self.attention else {}
        return EditedImage(data=encode_jpeg(array, quality=95), model=self.model,
                           details={"pipeline": type(self.pipeline).__name__, "seed": job.seed, "steps": self.steps,
                                    "prompt_truncated": self._truncated(job.instruction),
                                    "guidance_scale": self.guidance_scale,
                                    "image_guidance_scale": self.image_guidance_scale,
                                    "working_size": list(job.size), "batch_size": batch_size,
                                    "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
                                    **extra})
