"""Pixel metrics of one edit: context preservation (CP) two ways, MedGEN-Bench's SSIM / PSNR / LPIPS, reading ROI
masks (the task's region and edit masks are computed in generation/masks.py).

Context preservation = SSIM between the input and the edited image outside the region of interest (ROI):

* ``correct``: the SSIM map of the two whole RGB images (scikit-image defaults: 7x7 uniform window, K1 0.01,
  K2 0.03, range 255), averaged over the pixels whose window does not touch the ROI (the ROI dilated by half the
  window) and that scikit-image's own mean would use (the border of half a window is left out). An edit confined
  to the ROI gives exactly 1 whatever the ROI's size.
* ``medebench``: MedEBench's published code (src/eval_metrics/traditional_metrics_eval.py): the edit resized to
  the input's size (bicubic), the mask to it (nearest); both images multiplied by (1 - mask/255) in float32 and
  truncated back to uint8 as torchvision's ToTensor/ToPILImage do; then ``structural_similarity(input, edited,
  channel_axis=-1)`` over the whole image. The zeroed ROI is identical in both images and counts as perfect
  similarity, so the score grows with the ROI's size whatever happened outside it.

MedGEN-Bench's pixel metrics: SSIM on grayscale images (PIL "L", data range 255), PSNR on RGB (identical images
give 100), LPIPS (AlexNet, 256², inputs scaled to [-1, 1]) only when the `lpips` package and its weights are
already on this machine; nothing is downloaded.

SSIM maps are computed here (`ssim_map`), not by scikit-image: only where both of its means look (the pixels whose
window lies wholly inside the image), from exact integer window sums of the 8-bit values (sums of seven shifted
rows, then columns), so a map costs a fifth of scikit-image's and equals its map there to about 1e-12 (scikit-image
filters in floating point). An edit's CP and SSIM share its maps (`PairMaps`): for a grey pair (R = G = B in both
images, as X-rays and MRI come) one map serves the three channels CP averages and the "L" image SSIM reads, which
is the same grey. MedEBench's CP keeps calling scikit-image, as its code does.

CP is undefined (None) when no 7x7 window lies wholly outside the ROI (a full or nearly full mask, or an image
smaller than the window): such a sample is left out of the CP mean, and the report says how many were
(``CP_UNDEFINED``). MedEBench's mode is always defined.

16-bit images (PNG/TIFF modes I;16 and I) are read two ways, by CP mode:

* ``correct``: min–max scaled to 0–255 per image (generation.records.decode_rgb, as the generator reads sources),
  so a 12-bit CT or X-ray keeps its contrast. Values are comparable within one image, not across images.
* ``medebench``: as MedEBench's code reads every image, ``Image.open(path).convert("RGB")``, which clips values
  above 255 (a typical 16-bit radiograph becomes almost all white). This reproduces its numbers, not a good CP.

Masks (``read_mask`` / ``mask_levels``) may be encoded any way: boolean, 0/1, 0/255, labels, Pillow modes 1, L,
LA, P (palette colours), RGB/RGBA (brightest channel; the alpha channel when the colour is constant), 16-bit or
float. 8-bit masks reaching 128 or more are used as they are (grey levels, MedEBench's weights); 16-bit and
float masks are scaled to 0-255; a non-empty mask that stays below 128 after that (0/1, small labels) is read as
non-zero = ROI. White (or the larger value) is the region of interest.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image
from skimage.metrics import structural_similarity

from ..generation.records import open_image
from ..generation.failures import UsageError

CP_MODES = ("correct", "medebench")
SSIM_WINDOW = 7  # scikit-image's default
PSNR_IDENTICAL = 100.0
LPIPS_SIZE = 256
ALEXNET_CHECKPOINT = "alexnet-owt-7be5be79.pth"  # torchvision's ImageNet AlexNet, LPIPS's backbone
ALEXNET_URL = f"https://download.pytorch.org/models/{ALEXNET_CHECKPOINT}"  # where torchvision itself fetches it
CP_UNDEFINED = "no 7x7 SSIM window lies wholly outside the ROI (a full or nearly full mask)"  # why CP is None


def decode_medebench(data: bytes) -> np.ndarray:
    """An image read as MedEBench reads it: ``Image.open(...).convert("RGB")`` (16-bit values clipped at 255)."""
    with open_image(data) as im:
        try:
            return np.asarray(im.convert("RGB"))
        except (OSError, SyntaxError) as exc:
            raise UsageError(f"not a readable image: {exc}") from exc


# ---------------------------------------------------------------- sizes and masks

def to_size(rgb: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, bool]:
    """`rgb` at the height and width of `shape` (PIL bicubic, as MedEBench resizes edits); whether it was resized."""
    height, width = shape[:2]
    if rgb.shape[:2] == (height, width):
        return rgb, False
    return np.asarray(Image.fromarray(rgb).resize((width, height), Image.BICUBIC)), True


def read_mask(mask, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
    """A mask (PIL image of any mode, or array of any dtype) as uint8 grey levels at `shape`, resized nearest;
    and how its values were read (see the module docstring)."""
    levels, how = _levels(_channel(mask) if isinstance(mask, Image.Image) else np.asarray(mask))
    height, width = shape[:2]
    if levels.shape != (height, width):
        levels = np.asarray(Image.fromarray(levels).resize((width, height), Image.NEAREST))
    return levels, how


def mask_levels(mask, shape: tuple[int, ...]) -> np.ndarray:
    """`read_mask` without the description; idempotent on its own output."""
    return read_mask(mask, shape)[0]


def _channel(im: Image.Image) -> np.ndarray:
    """One channel of a mask image in its own numeric range (uint8, uint16/int32 for 16-bit, float, bool)."""
    if im.mode == "P":  # palette indices mean nothing by themselves; their colours do, unless all are alike
        colours = np.asarray(im.convert("RGB")).max(axis=-1)
        indices = np.asarray(im)
        return indices if colours.min() == colours.max() and indices.min() != indices.max() else colours
    if im.mode in ("LA", "RGBA", "PA"):
        bands = np.asarray(im.convert("RGBA"))
        colour = bands[..., :3].max(axis=-1)
        return bands[..., 3] if colour.min() == colour.max() else colour
    if im.mode in ("1", "L", "I;16", "I;16B", "I;16L", "I", "F"):
        return np.asarray(im)
    return np.asarray(im.convert("RGB")).max(axis=-1)  # RGB, CMYK, YCbCr...: a coloured ROI counts fully


def _levels(a: np.ndarray) -> tuple[np.ndarray, str]:
    if a.ndim == 3:  # an RGB(A) array: the brightest colour channel
        a = a[..., :3].max(axis=-1) if a.shape[-1] >= 3 else a[..., 0]
    if a.dtype == bool:
        return a.astype(np.uint8) * 255, "binary (true = ROI)"
    if a.size == 0 or a.max() <= 0:
        return np.zeros(a.shape, np.uint8), "empty"
    lo, hi = a.min(), a.max()
    if a.dtype == np.uint8:
        scaled, how = a, "grey levels"
    elif lo >= 0 and np.all((a == lo) | (a == hi)):  # two values in any wider encoding: binary
        return np.where(a == hi, 255, 0).astype(np.uint8), f"binary {lo:g}/{hi:g}"
    elif np.issubdtype(a.dtype, np.floating):
        scaled = np.clip(a * 255.0 if hi <= 1 else a, 0, 255).astype(np.uint8)
        how = "float levels" + (" x 255" if hi <= 1 else "")
    else:  # 16-bit (I;16, I): the 16-bit range onto 0-255
        scaled, how = np.clip(a.astype(np.float64) / 257.0, 0, 255).astype(np.uint8), "16-bit levels / 257"
    if scaled.max() < 128:  # nothing would count as ROI although the mask is not empty: 0/1 or labels
        return np.where(a > 0, 255, 0).astype(np.uint8), f"labels 0-{hi:g} (non-zero = ROI)"
    return scaled, how


# ---------------------------------------------------------------- context preservation

def window_sums(values: np.ndarray) -> np.ndarray:
    """Sums over every SSIM_WINDOW x SSIM_WINDOW window wholly inside `values` (integers below 2**16), exactly: a
    (H - 6) x (W - 6) int32 array (at most 49 x 65025)."""
    height, width = values.shape
    rows = np.add(values[:height - SSIM_WINDOW + 1], values[1:height - SSIM_WINDOW + 2], dtype=np.int32)
    for i in range(2, SSIM_WINDOW):
        rows += values[i:height - SSIM_WINDOW + 1 + i]
    sums = np.add(rows[:, :width - SSIM_WINDOW + 1], rows[:, 1:width - SSIM_WINDOW + 2])
    for j in range(2, SSIM_WINDOW):
        sums += rows[:, j:width - SSIM_WINDOW + 1 + j]
    return sums


_N = SSIM_WINDOW * SSIM_WINDOW
_C1 = (0.01 * 255) ** 2 * _N * _N  # scikit-image's C1 = (K1 R)^2 and C2, scaled as the sums below are
_C2 = (0.03 * 255) ** 2 * _N * (_N - 1)


def ssim_map(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The SSIM map of two uint8 grey images of one size, scikit-image's defaults (7x7 uniform window, K1 0.01, K2
    0.03, sample covariance, data range 255), at the pixels whose window lies wholly inside the image ((H - 6) x
    (W - 6): where scikit-image's mean and CP look). With window sums s of x, y, x², y², xy over n pixels,
    SSIM = (2 sx sy + C1 n²)(2 (n sxy - sx sy) + C2 n(n-1)) / ((sx² + sy² + C1 n²)(n (sxx + syy) - sx² - sy² +
    C2 n(n-1))): scikit-image's formula with its means and variances multiplied out, every integer in it exact."""
    if min(a.shape[:2]) < SSIM_WINDOW:
        raise ValueError(f"an image of {a.shape[1]}x{a.shape[0]} pixels is smaller than the {SSIM_WINDOW}x"
                         f"{SSIM_WINDOW} SSIM window")
    x, y = a.astype(np.int32), b.astype(np.int32)
    sx, sy = window_sums(x), window_sums(y)
    sxy = window_sums(x * y)
    sxx = window_sums(x * x)
    sxx += window_sums(y * y)
    products = sx * sy
    squares = sx * sx
    squares += sy * sy
    sxy *= _N
    sxy -= products
    sxx *= _N
    sxx -= squares
    ssim = (2.0 * products + _C1) * (2.0 * sxy + _C2)
    ssim /= (squares + _C1) * (sxx + _C2)
    return ssim


def is_grey(rgb: np.ndarray) -> bool:
    """Whether an RGB image's three channels are equal (then PIL's "L" of it is that channel)."""
    return bool((rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all())


def luma(rgb: np.ndarray) -> np.ndarray:
    """PIL's "L" of a uint8 RGB image (its own channel for a grey one: L's weights sum to one)."""
    if is_grey(rgb):
        return rgb[..., 0]
    return np.asarray(Image.fromarray(rgb).convert("L"))


class PairMaps:
    """The SSIM maps of a source and an edit of its size (uint8 RGB) that its CP and SSIM share, each computed once
    when first asked for: `channels` (the mean of the R, G and B maps: CP's) and `grey` (the map of their "L"
    images: SSIM's); one map for both when the pair is grey."""

    def __init__(self, source: np.ndarray, edited: np.ndarray):
        self.source, self.edited = source, edited
        self._grey_pair = is_grey(source) and is_grey(edited)
        self._channels: np.ndarray | None = None
        self._grey: np.ndarray | None = None

    @property
    def grey(self) -> np.ndarray:
        if self._grey is None:
            self._grey = ssim_map(luma(self.source), luma(self.edited))
        return self._grey

    @property
    def channels(self) -> np.ndarray:
        if self._grey_pair:
            return self.grey
        if self._channels is None:
            total = ssim_map(self.source[..., 0], self.edited[..., 0])
            total += ssim_map(self.source[..., 1], self.edited[..., 1])
            total += ssim_map(self.source[..., 2], self.edited[..., 2])
            total /= 3
            self._channels = total
        return self._channels


def cp_correct(source: np.ndarray, edited: np.ndarray, roi: np.ndarray, maps: PairMaps | None = None) -> float | None:
    """Mean RGB SSIM map over the pixels whose 7x7 window lies outside the ROI (and inside the image); None when no
    pixel does. `maps`: the pair's, when SSIM shares them."""
    channels = (maps or PairMaps(source, edited)).channels  # an image smaller than the window raises here
    outside = window_sums(roi.astype(np.uint8)) == 0  # no ROI pixel in the window: the ROI dilated by half of it
    if not outside.any():
        return None
    return float(channels[outside].mean())


def medebench_masked(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """`image` * (1 - mask/255) through float32 in [0, 1] and back with truncation (ToTensor, ToPILImage)."""
    keep = (np.float32(1.0) - mask.astype(np.float32) / np.float32(255.0))[..., None]
    return ((image.astype(np.float32) / np.float32(255.0)) * keep * np.float32(255.0)).astype(np.uint8)


def cp_medebench(source: np.ndarray, edited: np.ndarray, mask: np.ndarray) -> float:
    """MedEBench's masked SSIM: ROI zeroed in both images, SSIM over the whole RGB image (skimage defaults)."""
    levels = mask_levels(mask, source.shape)
    edited, _ = to_size(edited, source.shape)
    return float(structural_similarity(medebench_masked(source, levels), medebench_masked(edited, levels),
                                       channel_axis=-1))


def context_preservation(source: np.ndarray, edited: np.ndarray, mask: np.ndarray, mode: str,
                         maps: PairMaps | None = None) -> float | None:
    """CP in `mode`; `mask` in any encoding (read_mask), at the source's size (MedEBench weighs by its grey
    levels; the correct mode takes levels above 127 as the ROI). None: CP_UNDEFINED. `maps`: the pair's SSIM maps
    (the correct mode's), when they are shared."""
    if mode == "correct":
        roi = mask_levels(mask, source.shape) > 127
        return cp_correct(source, to_size(edited, source.shape)[0], roi, maps)
    if mode == "medebench":
        return cp_medebench(source, edited, mask)
    raise UsageError(f"CP mode must be one of {', '.join(CP_MODES)}, not {mode!r}")


# ---------------------------------------------------------------- MedGEN-Bench pixel metrics

def ssim_gray(a: np.ndarray, b: np.ndarray, maps: PairMaps | None = None) -> float:
    """Full-image SSIM of the grayscale images (PIL "L"), data range 255 (scikit-image's mean: the border of half a
    window left out). `maps`: the pair's (`b` at `a`'s size), when CP shares them."""
    return float((maps or PairMaps(a, to_size(b, a.shape)[0])).grey.mean(dtype=np.float64))


def psnr_rgb(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR over the RGB values (range 255); identical images give 100. The squared differences are summed as
    integers, exactly."""
    b = to_size(b, a.shape)[0]
    difference = a.astype(np.int32) - b
    flat = difference.ravel()
    mse = float(np.einsum("i,i->", flat, flat, dtype=np.int64)) / flat.size
    return PSNR_IDENTICAL if mse == 0 else 10 * math.log10(255.0**2 / mse)


class LPIPSUnavailable(UsageError, RuntimeError):
    """LPIPS cannot be computed on this machine; the message says why and what to install or place."""


def lpips_input(rgb: np.ndarray) -> np.ndarray:
    """1x3x256x256 float32 in [-1, 1], as LPIPS expects (bilinear resize)."""
    im = Image.fromarray(rgb).convert("RGB").resize((LPIPS_SIZE, LPIPS_SIZE), Image.BILINEAR)
    return (np.asarray(im, dtype=np.float32) / 127.5 - 1.0).transpose(2, 0, 1)[None]


class LPIPSMetric:
    """LPIPS (AlexNet) from weights already on disk; construction raises LPIPSUnavailable otherwise."""

    def __init__(self):
        try:
            import lpips
            import torch
        except ImportError as exc:
            raise LPIPSUnavailable(f"LPIPS not computed: {exc.name} is not installed. It needs `pip install lpips "
                                   "torch torchvision` (in no medbanana extra: lpips ships only its linear layers, "
                                   "its AlexNet is torchvision's ImageNet weights, which medbanana never downloads) "
                                   f"and {ALEXNET_URL} saved in torch's hub cache as checkpoints/{ALEXNET_CHECKPOINT}; "
                                   "--no-lpips skips it") from None
        hub = Path(torch.hub.get_dir()) / "checkpoints"
        needed = [hub / ALEXNET_CHECKPOINT, Path(lpips.__file__).parent / "weights" / "v0.1" / "alex.pth"]
        missing = [str(p) for p in needed if not p.is_file()]
        if missing:
            raise LPIPSUnavailable(f"LPIPS not computed: missing {', '.join(missing)} (medbanana downloads nothing: "
                                   f"save {ALEXNET_URL} into {hub}/ once); --no-lpips skips it")
        self._torch = torch
        self._model = lpips.LPIPS(net="alex", verbose=False).eval()

    def __call__(self, a: np.ndarray, b: np.ndarray) -> float:
        with self._torch.no_grad():
            x, y = (self._torch.from_numpy(lpips_input(v)) for v in (a, b))
            return float(self._model(x, y).item())


def pixel_metrics(source: np.ndarray, edited: np.ndarray, mask: np.ndarray, *, cp_mode: str,
                  ground_truth: np.ndarray | None = None, lpips: LPIPSMetric | None = None) -> dict:
    """CP in `cp_mode` (`mask`: ROI grey levels at the source's size, all 0 for none); SSIM, PSNR (and LPIPS) of
    the edit against the input, and against the ground truth when there is one."""
    maps = PairMaps(source, to_size(edited, source.shape)[0])  # CP's and SSIM's, computed once
    out = {"cp": context_preservation(source, edited, mask, cp_mode, maps),
           "ssim": ssim_gray(source, edited, maps), "psnr": psnr_rgb(source, edited),
           "lpips": lpips(source, to_size(edited, source.shape)[0]) if lpips else None}
    if ground_truth is not None:
        out.update(ssim_gt=ssim_gray(ground_truth, edited), psnr_gt=psnr_rgb(ground_truth, edited),
                   lpips_gt=lpips(ground_truth, to_size(edited, ground_truth.shape)[0]) if lpips else None)
    return out
