"""A JPEG header reader for the common case: size, components and EXIF orientation from the
markers before the first scan, without building a PIL image (a fraction of what opening the file
with PIL costs).

It answers only for baseline/progressive 8-bit JPEGs with 1 or 3 components whose orientation
is in an EXIF APP1 block it can read; for anything else (MPO files, an XMP block without an EXIF
orientation tag, as Pillow then reads the orientation from the XMP, 12-bit or CMYK files, two
frame headers, odd EXIF layouts, malformed segments) it returns ``None`` and the caller asks
Pillow, so its answers are always Pillow's. Marker layout: ITU-T T.81 annex B; EXIF: CIPA DC-008 (TIFF IFD0, tag 0x0112).

Where Pillow's JPEG plugin (``JpegImagePlugin._open``, 12.x) reads a header differently from
the standard, the reader declines too: markers Pillow takes without a length field (JPG, JPGn,
a second SOI) or as a frame header (DHP), TEM (not in Pillow's table: "no marker found"),
segments Pillow fails on (a frame header whose component list is cut, a JFIF or Adobe block
under 7 bytes, an ICC block under 14, a Photoshop resource cut after its code) and EXIF blocks
where Pillow stops reading IFD0 before the orientation (an earlier entry's data out of the block).
"""
from __future__ import annotations

import re
import struct
from typing import NamedTuple

_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}   # frame headers (DHT, JPG, DAC are not)
_STANDALONE = frozenset(range(0xD0, 0xD8))                   # RSTn: no length field
# markers Pillow reads otherwise than by their length field (see the module docstring)
_PILLOW_ODD = frozenset(range(0xF0, 0xFE)) | {0x01, 0xC8, 0xD8, 0xDE}
_EXIF = b"Exif\x00\x00"
_XMP = b"http://ns.adobe.com/xap/1.0/\x00"
_MPF = b"MPF\x00"
_ORIENTATION = 0x0112


class JpegHeader(NamedTuple):
    width: int           # stored size, before EXIF orientation
    height: int
    components: int      # 1 (gray) or 3
    orientation: int     # EXIF orientation 1..8 (1 when there is no EXIF block or no tag)


def read_jpeg_header(data) -> JpegHeader | None:
    """The header of ``data`` (bytes-like, a whole JPEG file), or ``None`` when this reader does
    not answer for it (see the module docstring): the caller then uses Pillow."""
    head = bytes(data[:65536]) if not isinstance(data, bytes) else data
    n = len(head)
    if n < 4 or head[0] != 0xFF or head[1] != 0xD8:
        return None
    pos, frame, orientation = 2, None, 0   # 0: no EXIF orientation tag (yet)
    exif_seen = xmp_seen = False
    while pos + 4 <= n:
        if head[pos] != 0xFF:
            return None
        marker = head[pos + 1]
        if marker == 0xFF:          # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker < 0xC0 or marker in _PILLOW_ODD:   # not read as a segment by Pillow
            return None
        if marker == 0xDA:          # start of scan: the header ends here
            break
        if marker == 0xD9:
            return None
        (length,) = struct.unpack_from(">H", head, pos + 2)
        body = pos + 4
        end = pos + 2 + length
        if length < 2 or end > n:
            return None
        if marker in _SOF:          # Pillow reads the component list 3 bytes at a time
            if frame is not None or length < 8 or (length - 8) % 3:
                return None
            precision, height, width, comps = struct.unpack_from(">BHHB", head, body)
            frame = (precision, width, height, comps)
        elif marker == 0xE1:        # APP1: EXIF or XMP
            if head[body:end].startswith(_XMP):
                xmp_seen = True     # Pillow reads its orientation only if EXIF has none
            elif head.startswith(_EXIF, body):
                if exif_seen:       # Pillow joins the blocks
                    return None
                exif_seen = True
                orientation = _exif_orientation(head[body + 6:end])
                if orientation is None:
                    return None
        elif marker == 0xE2 and head.startswith(_MPF, body):
            return None             # Pillow opens it as MPO
        elif marker == 0xDB and not _tables_fit(head[body:end]):
            return None             # Pillow raises "bad quantization table marker"
        elif 0xE0 <= marker <= 0xEF and not _app_fits(marker, head[body:end]):
            return None             # Pillow fails on the block (IndexError, struct.error)
        pos = end
    else:
        return None                 # no start of scan within the bytes read
    if frame is None:
        return None
    precision, width, height, comps = frame
    if precision != 8 or comps not in (1, 3) or width == 0 or height == 0 or (xmp_seen and not orientation):
        return None
    return JpegHeader(width, height, comps, orientation or 1)


def jpeg_precision(data) -> int | None:
    """The sample precision in bits (8, 12 or 16) of a JPEG's first frame header, or ``None``
    when ``data`` is not a JPEG or no frame header is found in its first 64 KiB."""
    head = bytes(data[:65536])
    if head[:2] != b"\xff\xd8":
        return None
    pos = 2
    while pos + 4 < len(head):
        if head[pos] != 0xFF:
            return None
        marker = head[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        if marker in _STANDALONE or marker == 0x01:
            pos += 2
            continue
        if marker in _SOF:
            return head[pos + 4]
        if marker in (0xD9, 0xDA):
            return None
        (length,) = struct.unpack_from(">H", head, pos + 2)
        if length < 2:
            return None
        pos += 2 + length
    return None


def _exif_orientation(tiff: bytes) -> int | None:
    """Orientation tag of IFD0 in a TIFF block: 1..8, 0 if absent, None if unreadable or odd."""
    if len(tiff) < 8:
        return None
    order = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if order is None or struct.unpack_from(order + "H", tiff, 2)[0] != 42:
        return None
    (ifd,) = struct.unpack_from(order + "I", tiff, 4)
    if ifd + 2 > len(tiff):
        return None
    (count,) = struct.unpack_from(order + "H", tiff, ifd)
    if ifd + 2 + 12 * count > len(tiff):
        return None
    found = []
    for k in range(count):
        tag, typ, num = struct.unpack_from(order + "HHI", tiff, ifd + 2 + 12 * k)
        size = num * _TIFF_UNIT.get(typ, 0)
        if size > 4 and not found:
            # Pillow stops reading IFD0 at an entry whose data lies outside the block
            (offset,) = struct.unpack_from(order + "I", tiff, ifd + 2 + 12 * k + 8)
            if offset + size > len(tiff):
                return None
        if tag == _ORIENTATION:
            if typ != 3 or num != 1:
                return None
            found.append(struct.unpack_from(order + "H", tiff, ifd + 2 + 12 * k + 8)[0])
    if not found:
        return 0
    return found[0] if len(found) == 1 and 1 <= found[0] <= 8 else None


#: bytes per value of each TIFF type Pillow reads (``ImageFileDirectory_v2._load_dispatch``)
_TIFF_UNIT = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8}


def _app_fits(marker: int, s: bytes) -> bool:
    """False for the APPn blocks Pillow's ``APP`` handler or its SOF handler fail on."""
    if marker in (0xE0, 0xEE) and s.startswith(b"JFIF" if marker == 0xE0 else b"Adobe"):
        return len(s) >= 7           # i16(s, 5)
    if marker == 0xE2 and s.startswith(b"ICC_PROFILE\0"):
        return len(s) >= 14          # the frame header reads the fragment count, s[13]
    if marker == 0xED and s.startswith(b"Photoshop 3.0\0"):
        offset = 14                  # Pillow's 8BIM walk: only a cut name length raises
        while s[offset:offset + 4] == b"8BIM":
            offset += 4
            if offset + 2 > len(s):
                return True          # struct.error: Pillow stops there
            offset += 2
            if offset >= len(s):
                return False         # s[offset]: IndexError
            offset += 1 + s[offset]
            offset += offset & 1
            if offset + 4 > len(s):
                return True
            offset += 4 + struct.unpack_from(">I", s, offset)[0]
            offset += offset & 1
    return True


def _tables_fit(s: bytes) -> bool:
    """Pillow's DQT check: each table is 1 + 64 (8-bit) or 1 + 128 (16-bit) bytes."""
    while s:
        size = 1 + 64 * (1 if s[0] // 16 == 0 else 2)
        if len(s) < size:
            return False
        s = s[size:]
    return True


def has_eoi(data) -> bool:
    """True when the JPEG's last bytes hold its end-of-image marker (FF D9; it cannot occur inside
    entropy-coded data; trailing bytes after it within the last KiB are allowed, as libjpeg ignores
    them). ``data``: a whole JPEG file (bytes-like). A file cut short (a partial download) lacks it:
    the reduced and DALI decode paths leave such files to a whole decode, which names them
    truncated."""
    return bytes(data[-1024:]).rfind(b"\xff\xd9") != -1


# -- the end of a JPEG: where the first scan's data may stop ---------------------------------------
# After the first start of scan (SOS) a JPEG holds entropy-coded data, restart markers, the tables
# and scans of later passes (DHT, DAC, DQT, DRI, SOS, DNL, COM, APPn) and ends with EOI. Any other
# marker before the EOI (a second SOI, a frame header, a reserved code) means the data stops short:
# the usual case is a file cut off and followed by another whole JPEG. libjpeg stops with an error
# there (Pillow: "broken data stream"); other decoders (DALI's) may return the half-decoded
# pixels. Checking the markers here lets both engines name such a file the same way.
# the markers libjpeg stops on there (jdmarker.c: an unknown marker, a second SOI or frame header,
# DHP/EXP, JPGn), and EOI; TEM (0x01) and RSTn have no length field and are passed over
_END = re.compile(rb"\xff([\x02-\xbf\xc0-\xc3\xc5-\xcb\xcd-\xcf\xd8\xd9\xde\xdf\xf0-\xfd])")
_ANY = re.compile(rb"\xff([^\x00\x01\xff\xd0-\xd7])")
_SEGMENT_AFTER_SOS = frozenset({0xC4, 0xCC, 0xDB, 0xDD, 0xDA, 0xDC, 0xFE, *range(0xE0, 0xF0)})


def scan_end_error(data) -> str | None:
    """A message when a marker that cannot be inside a JPEG's image data comes before its EOI
    (see above), else None (a good end, no EOI at all, or no answer: the decoder judges).
    ``data``: a whole JPEG file (bytes-like). One C scan over the bytes; markers inside the
    segments of later passes are told apart only when that scan finds a suspect."""
    if not isinstance(data, (bytes, bytearray)):
        data = memoryview(data)
        if data.format != "B":   # a pyarrow buffer's view is signed ("b"): index as unsigned bytes
            data = data.cast("B")
    start = _first_scan(data)
    if start is None:
        return None
    m = _END.search(data, start)
    if m is None or m.group(1) == b"\xd9":
        return None
    pos, skip = start, start      # a suspect: walk the markers, skipping segments by their length
    for m in _ANY.finditer(data, pos):
        p = m.start()
        if p < skip:
            continue
        code = m.group(1)[0]
        if code == 0xD9:
            return None
        if code in _SEGMENT_AFTER_SOS:
            if p + 4 > len(data):
                return None
            skip = p + 2 + ((data[p + 2] << 8) | data[p + 3])
            continue
        name = "SOI" if code == 0xD8 else (f"SOF{code - 0xC0}" if code in _SOF else f"0x{code:02X}")
        return (f"marker {name} at byte {p}, inside the image data (before its end marker): the image stops "
                "short there" + (", and another image starts" if code == 0xD8 else ""))
    return None


def _segments(data):
    """The marker segments of a JPEG up to its first scan: ``(code, offset of the marker, length
    of the segment after the marker)``, the last one the SOS; stops early (no SOS) where the
    markers do not parse: not a JPEG, a byte that is not a marker, a second SOI or an EOI, a
    length below 2. Fill bytes and markers without a length are passed over."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return
    pos = 2
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return
        code = data[pos + 1]
        if code == 0xFF:
            pos += 1
            continue
        if code in _STANDALONE or code == 0x01:
            pos += 2
            continue
        if code in (0xD8, 0xD9):
            return
        length = (data[pos + 2] << 8) | data[pos + 3]
        if length < 2:
            return
        yield code, pos, length
        if code == 0xDA:
            return
        pos += 2 + length


def _first_scan(data) -> int | None:
    """Offset just past the first SOS segment's header, or None when the markers before it do
    not parse."""
    for code, pos, length in _segments(data):
        if code == 0xDA:
            end = pos + 2 + length
            return end if end <= len(data) else None
    return None


#: frame headers whose height field a decoder may be given smaller (Huffman baseline, extended
#: sequential, progressive): :func:`frame_rows`
_ROWS_SOF = frozenset({0xC0, 0xC1, 0xC2})


def frame_rows(data) -> tuple[int, int] | None:
    """``(offset of the frame header's 16-bit height field, largest vertical sampling factor)``
    of a single-frame Huffman JPEG (SOF0, SOF1, SOF2) with a height in its frame header, or None
    (no such frame before the first scan, markers that do not parse, a second frame header).

    Giving libjpeg the same file with a smaller height ``r`` (:func:`with_rows`) decodes the first
    ``r`` rows only, and all but the last ``8 * factor`` of them (one row of MCUs: its chroma
    upsampling would lack the row below) are the full decode's rows to the bit."""
    found = None
    for code, pos, length in _segments(data):
        if pos + 2 + length > len(data):
            return None
        if code in _SOF:
            if found is not None or code not in _ROWS_SOF or length < 8:
                return None
            comps = data[pos + 9]
            if length != 8 + 3 * comps or comps == 0:
                return None
            height = (data[pos + 5] << 8) | data[pos + 6]
            vmax = max(data[pos + 11 + 3 * i] & 0x0F for i in range(comps))
            if height == 0 or not 1 <= vmax <= 4:
                return None
            found = (pos + 5, vmax)
        if code == 0xDA:
            return found
    return None


def with_rows(data, offset: int, rows: int) -> bytes:
    """A copy of ``data`` whose frame header (height field at ``offset``, from
    :func:`frame_rows`) declares ``rows`` rows (1 to 65535)."""
    out = bytearray(data)
    struct.pack_into(">H", out, offset, rows)
    return bytes(out)
