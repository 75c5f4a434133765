"""The machine-readable synthetic-content mark on every image the generator writes.

`mark_synthetic(data, run_id=..., models=...)` inserts an XMP packet into JPEG (an APP1 segment after SOI/JFIF) or
PNG (an iTXt chunk after IHDR) bytes without touching the compressed pixels: no decode, no re-encode, cost
proportional to the header only. The packet carries the IPTC Extension property `Iptc4xmpExt:DigitalSourceType`
(default `compositeWithTrainedAlgorithmicMedia`: a real scan changed by a trained model), `xmp:CreatorTool`, a
`dc:description` note and medbanana properties (run id, model names, caller-given extras). Pillow exposes the packet
as `Image.info["xmp"]` and `Image.getxmp()`; exiftool shows it as XMP-iptcExt:DigitalSourceType.
`read_mark(data)` returns it as a `ProvenanceMark`, or None when the bytes carry none.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from xml.etree import ElementTree
from xml.sax.saxutils import escape, quoteattr

IPTC_DST_PREFIX = "http://cv.iptc.org/newscodes/digitalsourcetype/"
# IPTC NewsCodes that describe machine-made content; the caller picks the one that is true of its editor.
SOURCE_TYPES = (
    "trainedAlgorithmicMedia",  # made entirely by a trained model
    "compositeWithTrainedAlgorithmicMedia",  # real content changed by a trained model (inpainting, editing)
    "compositeSynthetic",  # real content combined with non-trained synthetic elements (e.g. the offline simulator)
    "algorithmicMedia",  # made entirely by a non-trained algorithm
)
DEFAULT_SOURCE_TYPE = "compositeWithTrainedAlgorithmicMedia"
# the human-readable note's "what this is", per DigitalSourceType: it must say the same as the machine-readable type
WHAT_IT_IS = {
    "trainedAlgorithmicMedia": "an image made by an AI model",
    "compositeWithTrainedAlgorithmicMedia": "a scan edited by an AI model",
    "compositeSynthetic": "a scan edited by a procedural simulator (no trained model)",
    "algorithmicMedia": "an image made by a procedural algorithm (no trained model)",
}

NS = {
    "x": "adobe:ns:meta/",
    "rdf": "http://www.w3.org/1999/02/22-rdf-syntax-ns#",
    "dc": "http://purl.org/dc/elements/1.1/",
    "xmp": "http://ns.adobe.com/xap/1.0/",
    "Iptc4xmpExt": "http://iptc.org/std/Iptc4xmpExt/2008-02-29/",
    "medbanana": "urn:medbanana:provenance:1.0/",
}
JPEG_XMP_HEADER = b"http://ns.adobe.com/xap/1.0/\x00"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_XMP_KEYWORD = b"XML:com.adobe.xmp"
_MAX_JPEG_SEGMENT = 0xFFFF - 2  # payload bytes after the 2-byte length field
_PROPERTY_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_RESERVED = {"RunId", "Models"}
# characters XML 1.0 forbids even as &#..; references (C0 controls but tab/LF/CR, lone surrogates, U+FFFE/FFFF)
_NOT_XML_CHAR = re.compile(r"[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_TEXT_ENTITIES = {"\r": "&#13;"}  # a literal CR in element text reads back as LF (quoteattr does this already)


@dataclass
class ProvenanceMark:
    digital_source_type: str  # IPTC code, e.g. "compositeWithTrainedAlgorithmicMedia"
    run_id: str = ""
    models: dict[str, str] = field(default_factory=dict)  # role -> model name
    properties: dict[str, str] = field(default_factory=dict)  # other medbanana:* properties
    creator_tool: str = ""
    description: str = ""


@lru_cache(maxsize=1)
def creator_tool() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"medbanana {version('medbanana')}"
    except PackageNotFoundError:
        return "medbanana"


def xmp_text(value) -> str:
    """`value` as text an XML 1.0 packet can hold: each forbidden character becomes U+FFFD. Every value of the
    mark goes through this, so `read_mark` gives back exactly `xmp_text(value)`."""
    return _NOT_XML_CHAR.sub("\ufffd", str(value))


def _xmp_if_text(value):
    return xmp_text(value) if isinstance(value, str) else value  # JSON keeps non-text values as they are


def xmp_packet(run_id: str, models: dict[str, str] | None = None, *, source_type: str = DEFAULT_SOURCE_TYPE,
               extra: dict[str, str] | None = None, note: str | None = None) -> bytes:
    """The XMP packet (UTF-8) that `mark_synthetic` inserts."""
    if source_type not in SOURCE_TYPES:
        raise ValueError(f"unknown DigitalSourceType {source_type!r}; use one of {', '.join(SOURCE_TYPES)}")
    models = {_xmp_if_text(k): _xmp_if_text(v) for k, v in (models or {}).items()}
    props = {"RunId": xmp_text(run_id), "Models": json.dumps(models, sort_keys=True, ensure_ascii=False)}
    for name, value in (extra or {}).items():
        if not isinstance(name, str) or not _PROPERTY_NAME.match(name) or name in _RESERVED:
            raise ValueError(f"extra property name {name!r} must be a letter then letters/digits/_ and not "
                             f"{' or '.join(sorted(_RESERVED))}")
        props[name] = xmp_text(value)
    note = xmp_text(note or (f"Synthetic medical image: {WHAT_IT_IS[source_type]} (medbanana run "
                             f"{props['RunId']}). Not a real patient image; not for diagnosis."))
    # values only ever appear escaped: quoteattr for attributes, escape for the element text
    attrs = "".join(f"\n    medbanana:{k}={quoteattr(v)}" for k, v in props.items())
    packet = (
        '<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>\n'
        f'<x:xmpmeta xmlns:x="{NS["x"]}">\n'
        f' <rdf:RDF xmlns:rdf="{NS["rdf"]}">\n'
        '  <rdf:Description rdf:about=""'
        f'\n    xmlns:dc="{NS["dc"]}"\n    xmlns:xmp="{NS["xmp"]}"'
        f'\n    xmlns:Iptc4xmpExt="{NS["Iptc4xmpExt"]}"\n    xmlns:medbanana="{NS["medbanana"]}"'
        f'\n    Iptc4xmpExt:DigitalSourceType={quoteattr(IPTC_DST_PREFIX + source_type)}'
        f'\n    xmp:CreatorTool={quoteattr(creator_tool())}{attrs}>\n'
        f'   <dc:description><rdf:Alt><rdf:li xml:lang="x-default">{escape(note, _TEXT_ENTITIES)}</rdf:li></rdf:Alt>'
        '</dc:description>\n'
        '  </rdf:Description>\n </rdf:RDF>\n</x:xmpmeta>\n<?xpacket end="r"?>')
    return packet.encode("utf-8")


def mark_synthetic(data: bytes, run_id: str, models: dict[str, str] | None = None, *,
                   source_type: str = DEFAULT_SOURCE_TYPE, extra: dict[str, str] | None = None,
                   note: str | None = None) -> bytes:
    """JPEG or PNG bytes with the medbanana XMP mark; any earlier XMP packet is replaced, pixels are untouched."""
    packet = xmp_packet(run_id, models, source_type=source_type, extra=extra, note=note)
    if data[:2] == b"\xff\xd8":
        return _jpeg_with_xmp(data, packet)
    if data[:8] == PNG_SIGNATURE:
        return _png_with_xmp(data, packet)
    raise ValueError("mark_synthetic needs JPEG or PNG bytes")


def read_mark(data: bytes) -> ProvenanceMark | None:
    """The mark in JPEG/PNG bytes, or None when there is no XMP packet with a DigitalSourceType."""
    packet = xmp_of(data)
    if packet is None:
        return None
    try:
        root = ElementTree.fromstring(packet.strip(b"\x00 \r\n\t"))
    except ElementTree.ParseError:
        return None
    for desc in root.iter(f"{{{NS['rdf']}}}Description"):
        dst = _prop(desc, "Iptc4xmpExt", "DigitalSourceType")
        if not dst:
            continue
        med = {k.split("}", 1)[1]: v for k, v in desc.attrib.items() if k.startswith(f"{{{NS['medbanana']}}}")}
        description = desc.find("dc:description/rdf:Alt/rdf:li", NS)
        try:
            models = json.loads(med.pop("Models", "{}"))
        except json.JSONDecodeError:
            models = {}
        return ProvenanceMark(digital_source_type=dst.removeprefix(IPTC_DST_PREFIX), run_id=med.pop("RunId", ""),
                              models=models, properties=med, creator_tool=_prop(desc, "xmp", "CreatorTool"),
                              description=(description.text or "") if description is not None else "")
    return None


def _prop(desc: ElementTree.Element, prefix: str, name: str) -> str:
    """An XMP simple property written as an attribute (our form) or as a child element (other tools' form)."""
    key = f"{{{NS[prefix]}}}{name}"
    if key in desc.attrib:
        return desc.attrib[key]
    child = desc.find(key)
    return (child.text or "").strip() if child is not None else ""


def xmp_of(data: bytes) -> bytes | None:
    """The raw XMP packet of JPEG or PNG bytes, if any."""
    if data[:2] == b"\xff\xd8":
        for marker, start, end in jpeg_segments(data):
            if marker == 0xE1 and data[start:start + len(JPEG_XMP_HEADER)] == JPEG_XMP_HEADER:
                return data[start + len(JPEG_XMP_HEADER):end]
    elif data[:8] == PNG_SIGNATURE:
        for ctype, start, end in png_chunks(data):
            if ctype == b"iTXt" and data[start:end].startswith(PNG_XMP_KEYWORD + b"\x00"):
                return _itxt_text(data[start:end])
    return None


# --- JPEG -------------------------------------------------------------------------------------------------------
def jpeg_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker, payload start, payload end) of every header segment before the first scan (SOS included, last).

    Only marker segments are walked; the entropy-coded data after SOS is never read.
    """
    if data[:2] != b"\xff\xd8":
        raise ValueError("not JPEG bytes (no SOI marker)")
    out, pos, n = [], 2, len(data)
    while pos < n:
        if data[pos] != 0xFF:
            raise ValueError(f"corrupt JPEG header: expected a marker at byte {pos}")
        while pos < n and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= n:
            break
        marker = data[pos]
        pos += 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # standalone markers carry no length
            continue
        if marker == 0xD9:
            break
        if pos + 2 > n:
            raise ValueError("corrupt JPEG header: truncated segment length")
        (length,) = struct.unpack(">H", data[pos:pos + 2])
        if length < 2 or pos + length > n:
            raise ValueError(f"corrupt JPEG header: segment 0x{marker:02X} runs past the end")
        out.append((marker, pos + 2, pos + length))
        if marker == 0xDA:
            break
        pos += length
    return out


def _jpeg_with_xmp(data: bytes, packet: bytes) -> bytes:
    payload = JPEG_XMP_HEADER + packet
    if len(payload) > _MAX_JPEG_SEGMENT:
        raise ValueError(f"XMP packet of {len(payload)} bytes does not fit one JPEG APP1 segment")
    segments = jpeg_segments(data)
    ours = b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload
    parts, inserted = [b"\xff\xd8"], False
    for marker, start, end in segments:
        seg_start = start - 4
        if marker == 0xDA:  # the scan and everything after it, byte for byte
            if not inserted:
                parts.append(ours)
            parts.append(data[seg_start:])
            return b"".join(parts)
        if marker == 0xE1 and data[start:start + len(JPEG_XMP_HEADER)] == JPEG_XMP_HEADER:
            continue  # a single standard XMP packet per file: ours replaces it
        leading = marker == 0xE0 or (marker == 0xE1 and data[start:start + 6] == b"Exif\x00\x00")
        if not inserted and not leading:  # JFIF APP0 and Exif APP1 must directly follow SOI; XMP comes next
            parts.append(ours)
            inserted = True
        parts.append(data[seg_start:end])
    raise ValueError("corrupt JPEG: no scan (SOS) segment")


# --- PNG --------------------------------------------------------------------------------------------------------
def png_chunks(data: bytes) -> list[tuple[bytes, int, int]]:
    """(type, data start, data end) of every chunk up to IEND."""
    if data[:8] != PNG_SIGNATURE:
        raise ValueError("not PNG bytes")
    out, pos = [], 8
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        ctype = data[pos + 4:pos + 8]
        if pos + 12 + length > len(data):
            raise ValueError(f"corrupt PNG: chunk {ctype!r} runs past the end")
        out.append((ctype, pos + 8, pos + 8 + length))
        pos += 12 + length
        if ctype == b"IEND":
            break
    return out


def _itxt_text(chunk: bytes) -> bytes:
    # keyword \0 compression-flag compression-method language \0 translated-keyword \0 text
    _, rest = chunk.split(b"\x00", 1)
    compressed, rest = rest[0], rest[2:]
    _, rest = rest.split(b"\x00", 1)
    _, text = rest.split(b"\x00", 1)
    return zlib.decompress(text) if compressed else text


def _png_with_xmp(data: bytes, packet: bytes) -> bytes:
    body = PNG_XMP_KEYWORD + b"\x00\x00\x00\x00\x00" + packet
    ours = struct.pack(">I", len(body)) + b"iTXt" + body + struct.pack(">I", zlib.crc32(b"iTXt" + body))
    parts = [PNG_SIGNATURE]
    for ctype, start, end in png_chunks(data):
        if ctype == b"iTXt" and data[start:end].startswith(PNG_XMP_KEYWORD + b"\x00"):
            continue
        parts.append(data[start - 8:end + 4])
        if ctype == b"IHDR":
            parts.append(ours)
    return b"".join(parts)
