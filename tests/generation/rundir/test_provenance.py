"""The synthetic-content mark: inserted without re-encoding, read back by us and by Pillow."""

import importlib.util
import io
from xml.etree import ElementTree

import numpy as np
import pytest
from PIL import Image

from conftest import SHARED_SAMPLES
from medbanana.generation.sources.preprocess import ImageOptions, prepare_image
from medbanana.generation.rundir.provenance import (IPTC_DST_PREFIX, JPEG_XMP_HEADER, jpeg_segments, mark_synthetic,
                                             read_mark, xmp_of)
from prepare_fixtures import scan

MODELS = {"editor": "gemini-2.5-flash-image", "judge": "gemini-2.5-pro", "writer": "gemini-2.5-pro"}


def encode(image: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def scan_offset(data: bytes) -> int:
    """Where the SOS segment (and the compressed pixels) begins."""
    marker, start, _ = jpeg_segments(data)[-1]
    assert marker == 0xDA
    return start - 4


def test_jpeg_mark_keeps_the_compressed_pixels_byte_for_byte():
    original = encode(scan(1, mode="RGB"), quality=95)
    marked = mark_synthetic(original, "run-0001", MODELS, extra={"Task": "MIMIC/add/s1-Edema", "Round": "2"})
    assert marked[scan_offset(marked):] == original[scan_offset(original):]
    assert [m for m, _, _ in jpeg_segments(marked)][:2] == [0xE0, 0xE1]  # JFIF stays first, XMP right after
    with Image.open(io.BytesIO(marked)) as a, Image.open(io.BytesIO(original)) as b:
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert b"digitalsourcetype/compositeWithTrainedAlgorithmicMedia" in a.info["xmp"]  # Pillow finds it
    mark = read_mark(marked)
    assert mark.digital_source_type == "compositeWithTrainedAlgorithmicMedia"
    assert (mark.run_id, mark.models) == ("run-0001", MODELS)
    assert mark.properties == {"Task": "MIMIC/add/s1-Edema", "Round": "2"}
    assert mark.creator_tool.startswith("medbanana") and "run-0001" in mark.description


def test_pillow_getxmp_reads_the_iptc_property():
    if importlib.util.find_spec("defusedxml") is None:
        pytest.skip("Image.getxmp() needs defusedxml, which is not installed")
    marked = mark_synthetic(encode(scan(2)), "r1", source_type="trainedAlgorithmicMedia")
    with Image.open(io.BytesIO(marked)) as im:
        desc = im.getxmp()["xmpmeta"]["RDF"]["Description"]
    assert desc["DigitalSourceType"] == IPTC_DST_PREFIX + "trainedAlgorithmicMedia" and desc["RunId"] == "r1"


def test_marking_again_replaces_the_packet_and_keeps_exif():
    exif = Image.Exif()
    exif[0x0131] = "SomeEditor"  # Software
    foreign = b"<x:xmpmeta xmlns:x='adobe:ns:meta/'><rdf:RDF/></x:xmpmeta>"
    original = encode(scan(3), quality=90, exif=exif.tobytes(), xmp=foreign)
    twice = mark_synthetic(mark_synthetic(original, "first"), "second", source_type="compositeSynthetic")
    app1 = [twice[s:s + 29] for m, s, _ in jpeg_segments(twice) if m == 0xE1]
    assert app1[0].startswith(b"Exif") and app1[1:] == [JPEG_XMP_HEADER]  # Exif first, then one XMP packet
    mark = read_mark(twice)
    assert (mark.run_id, mark.digital_source_type) == ("second", "compositeSynthetic")
    assert twice[scan_offset(twice):] == original[scan_offset(original):]


def test_hostile_values_are_escaped_and_the_packet_is_valid_xml():
    run_id = 'x"><rdf:li>&injected;</rdf:li> \u00e9\u4e2d'
    marked = mark_synthetic(encode(scan(4)), run_id, {"editor": "a<b&c"})
    ElementTree.fromstring(xmp_of(marked))  # well-formed
    mark = read_mark(marked)
    assert mark.run_id == run_id and mark.models == {"editor": "a<b&c"}
    with pytest.raises(ValueError, match="extra property name"):
        mark_synthetic(encode(scan(4)), "r", extra={"bad name": "x"})
    with pytest.raises(ValueError, match="unknown DigitalSourceType"):
        mark_synthetic(encode(scan(4)), "r", source_type="photo")
    with pytest.raises(ValueError, match="JPEG or PNG"):
        mark_synthetic(b"GIF89a....", "r")


def test_no_decoding_happens_and_corrupt_headers_are_refused():
    good = encode(scan(5), quality=95)
    garbage_scan = good[:scan_offset(good) + 20] + bytes(np.random.default_rng(0).integers(0, 255, 500, np.uint8))
    marked = mark_synthetic(garbage_scan, "r")  # the compressed data is never looked at
    assert marked.endswith(garbage_scan[scan_offset(garbage_scan):]) and read_mark(marked).run_id == "r"
    with pytest.raises(ValueError, match="corrupt JPEG"):
        mark_synthetic(good[:30], "r")


def test_png_mark():
    original = encode(scan(6, mode="RGB"), "PNG")
    marked = mark_synthetic(original, "png-run", MODELS)
    with Image.open(io.BytesIO(marked)) as a, Image.open(io.BytesIO(original)) as b:
        assert np.array_equal(np.asarray(a), np.asarray(b)) and b"png-run" in a.info["xmp"]
    assert read_mark(marked).models == MODELS
    assert read_mark(mark_synthetic(marked, "again")).run_id == "again"


def test_prepared_sources_carry_no_mark_and_marked_edits_do():
    source = prepare_image(encode(scan(7), quality=90), ImageOptions(size=64)).data
    assert read_mark(source) is None and xmp_of(source) is None
    assert read_mark(mark_synthetic(source, "r")).digital_source_type == "compositeWithTrainedAlgorithmicMedia"


def test_real_released_edit():
    samples = sorted(SHARED_SAMPLES.glob("*/*/*.jpeg"))[:3]
    if not samples:
        pytest.skip(f"released sample images not found at {SHARED_SAMPLES}")
    for path in samples:
        original = path.read_bytes()
        marked = mark_synthetic(original, "sample-run", MODELS)
        assert len(marked) - len(original) < 2048 and read_mark(marked).run_id == "sample-run"
        with Image.open(io.BytesIO(marked)) as a, Image.open(path) as b:
            assert np.array_equal(np.asarray(a), np.asarray(b))
