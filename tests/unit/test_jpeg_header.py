"""The fast JPEG header reader answers as Pillow does, or not at all (feedgpu.stages.jpeg_header)."""
import io
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from feedgpu.errors import DecodeError
from feedgpu.stages import Decode
from feedgpu.stages.decode import Header
from feedgpu.stages.jpeg_header import read_jpeg_header

# Pillow warns about the broken EXIF and MPO blocks made here
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:PIL.*")

SHARED = Path(__file__).resolve().parents[3] / "shared"
CASES = sorted((SHARED / "cases" / "images").glob("*"))
PHOTOS = sorted((SHARED / "data" / "photos").glob("*"))


def pillow_header(decode: Decode, data):
    """Decode.header without the fast reader: what Pillow says (or the error it raises)."""
    slow = Decode(exif_orientation=decode.exif_orientation, max_pixels=decode.max_pixels)
    slow._jpeg_header = lambda data, head: None
    try:
        return slow.header(data)
    except DecodeError as e:
        return ("error", e.reason)


def both(decode: Decode, data):
    try:
        fast = decode.header(data)
    except DecodeError as e:
        fast = ("error", e.reason)
    return fast, pillow_header(decode, data)


def _jpeg(img: Image.Image, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", **kw)
    return out.getvalue()


def _photo(size=(120, 80), mode="RGB") -> Image.Image:
    img = Image.open(PHOTOS[0]) if PHOTOS else Image.new("RGB", (400, 300), (10, 200, 30))
    return img.convert("RGB").resize(size).convert(mode)


def _exif(orientation, tag_type=3, twice=False, order="<") -> bytes:
    e = Image.Exif()
    e[0x0112] = orientation
    raw = e.tobytes()
    if tag_type == 3 and not twice and order == "<":
        return raw
    # hand-built IFD0: one or two orientation entries of the given type
    entries = [(0x0112, tag_type, 1, orientation)] * (2 if twice else 1)
    mark = b"II" if order == "<" else b"MM"
    body = mark + struct.pack(order + "HI", 42, 8) + struct.pack(order + "H", len(entries))
    for tag, typ, num, val in entries:
        body += struct.pack(order + "HHI", tag, typ, num)
        body += struct.pack(order + "HH", val, 0) if typ == 3 else struct.pack(order + "I", val)
    return b"Exif\x00\x00" + body + struct.pack(order + "I", 0)


def _insert_app(data: bytes, marker: int, payload: bytes) -> bytes:
    seg = struct.pack(">BBH", 0xFF, marker, len(payload) + 2) + payload
    return data[:2] + seg + data[2:]


def made_variants() -> dict[str, bytes]:
    img = _photo()
    v = {"baseline": _jpeg(img), "progressive": _jpeg(img, progressive=True),
         "gray": _jpeg(_photo(mode="L")), "cmyk": _jpeg(_photo(mode="CMYK")),
         "subsampling_444": _jpeg(img, subsampling=0), "optimized": _jpeg(img, optimize=True),
         "restart_markers": _jpeg(img, restart_marker_blocks=1)}
    for o in range(0, 10):
        v[f"exif_{o}"] = _jpeg(img, exif=_exif(o))
    v["exif_long_type"] = _jpeg(img, exif=_exif(6, tag_type=4))
    v["exif_twice_in_ifd"] = _jpeg(img, exif=_exif(6, twice=True))
    v["exif_big_endian"] = _jpeg(img, exif=_exif(6, order=">"))
    v["exif_no_orientation"] = _jpeg(img, exif=Image.Exif().tobytes())
    v["xmp_orientation"] = _insert_app(_jpeg(img), 0xE1, b"http://ns.adobe.com/xap/1.0/\x00"
                                       b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>')
    v["two_exif_blocks"] = _insert_app(_jpeg(img, exif=_exif(3)), 0xE1, _exif(6))
    v["bad_dqt"] = _insert_app(_jpeg(img), 0xDB, b"\x00" + b"\x01" * 10)
    v["reserved_marker"] = _insert_app(_jpeg(img), 0x02, b"abc")
    v["mpf_app2"] = _insert_app(_jpeg(img), 0xE2, b"MPF\x00II*\x00\x08\x00\x00\x00")
    cut = _jpeg(img)
    v["truncated"] = cut[: len(cut) // 2]
    v["header_only"] = cut[:600]
    v["twelve_bit_sof"] = _twelve_bit(cut)
    return v


def _before_scan(data: bytes, raw: bytes) -> bytes:
    i = data.index(b"\xff\xda")
    return data[:i] + raw + data[i:]


def _exif_entries(entries) -> bytes:
    """An EXIF block whose IFD0 holds ``entries`` (tag, type, count, 4 value/offset bytes)."""
    body = b"II" + struct.pack("<HI", 42, 8) + struct.pack("<H", len(entries))
    body += b"".join(struct.pack("<HHI", tag, typ, num) + raw for tag, typ, num, raw in entries)
    return b"Exif\x00\x00" + body + struct.pack("<I", 0)


#: a 32 x 16 frame header (3 components), hidden where Pillow reads it and the standard does not
SOF_32x16 = b"\x08\x00\x10\x00\x20\x03\x01\x22\x00\x02\x11\x01\x03\x11\x01"


def pillow_odd_variants() -> dict[str, tuple[bytes, object]]:
    """Headers Pillow reads otherwise than the standard, with Pillow's answer (exif applied)."""
    img = _photo()
    base = _jpeg(img)
    sof = b"\xff\xc0" + struct.pack(">H", len(SOF_32x16) + 2) + SOF_32x16
    hidden = struct.pack(">H", len(sof) + 2) + sof   # a length field Pillow does not read
    i = base.index(b"\xff\xc0")
    (n,) = struct.unpack_from(">H", base, i + 2)
    not_an_image = ("error", "not an image")
    orient_6 = struct.pack("<HH", 6, 0)
    return {
        # markers Pillow does not skip by their length
        "tem_marker": (base[:2] + b"\xff\x01" + base[2:], not_an_image),
        "dhp_after_frame": (_before_scan(base, b"\xff\xde" + struct.pack(">H", len(SOF_32x16) + 2) + SOF_32x16),
                            Header(32, 16, True, True)),
        "jpg_marker_hides_frame": (_before_scan(base, b"\xff\xc8" + hidden), Header(32, 16, True, True)),
        "jpgn_marker_hides_frame": (_before_scan(base, b"\xff\xf3" + hidden), Header(32, 16, True, True)),
        "second_soi_hides_frame": (_before_scan(base, b"\xff\xd8" + hidden), Header(32, 16, True, True)),
        # blocks Pillow fails on
        "frame_component_list_cut": (base[:i + 2] + struct.pack(">H", n + 1) + base[i + 4:i + 2 + n] + b"\x01"
                                     + base[i + 2 + n:], not_an_image),
        "short_jfif": (_insert_app(base, 0xE0, b"JFIF\x00"), not_an_image),
        "short_adobe": (_insert_app(base, 0xEE, b"Adobe\x00"), not_an_image),
        "short_icc": (_insert_app(base, 0xE2, b"ICC_PROFILE\x00\x01"), not_an_image),
        "photoshop_cut_after_code": (_insert_app(base, 0xED, b"Photoshop 3.0\x008BIM\x04\x04"), not_an_image),
        # Pillow stops reading IFD0 at the Make entry (20 bytes at offset 5000): no orientation;
        # DALI may read the tag: Pillow decodes it
        "exif_entry_outside_block": (_jpeg(img, exif=_exif_entries([(0x010F, 2, 20, struct.pack("<I", 5000)),
                                                                    (0x0112, 3, 1, orient_6)])),
                                     Header(120, 80, False, True)),
        # an orientation only in XMP (Pillow reads it, DALI does not): Pillow decodes it
        "xmp_orientation_only": (_insert_app(base, 0xE1, XMP_6), Header(80, 120, False, False)),
        # the same entries within the block: rotated
        "exif_entry_inside_block": (_jpeg(img, exif=_exif_entries([(0x010F, 2, 4, b"abc\x00"),
                                                                   (0x0112, 3, 1, orient_6)])),
                                    Header(80, 120, True, False)),
        # EXIF has the orientation (3): Pillow ignores the XMP's; DALI reads the same EXIF tag
        "xmp_and_exif_orientation": (_insert_app(_jpeg(img, exif=_exif(3)), 0xE1, XMP_6), Header(120, 80, True, False)),
    }


XMP_6 = b"http://ns.adobe.com/xap/1.0/\x00" b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'


def _twelve_bit(data: bytes) -> bytes:
    i = data.index(b"\xff\xc0")
    return data[:i + 4] + b"\x0c" + data[i + 5:]


@pytest.mark.parametrize("path", CASES, ids=[p.name for p in CASES])
@pytest.mark.parametrize("exif", [True, False])
def test_case_files_get_pillows_answer(path, exif):
    data = path.read_bytes()
    fast, slow = both(Decode(exif_orientation=exif), data)
    assert fast == slow


@pytest.mark.parametrize("name", sorted(made_variants()))
@pytest.mark.parametrize("exif", [True, False])
def test_made_variants_get_pillows_answer(name, exif):
    data = made_variants()[name]
    fast, slow = both(Decode(exif_orientation=exif), data)
    assert fast == slow, name


def test_the_reader_answers_for_common_files_and_not_for_odd_ones():
    v = made_variants()
    for name in ("baseline", "progressive", "gray", "subsampling_444", "optimized", "restart_markers",
                 "exif_1", "exif_6", "exif_8", "exif_big_endian", "exif_no_orientation"):
        assert read_jpeg_header(v[name]) is not None, name
    for name in ("cmyk", "exif_0", "exif_9", "exif_long_type", "exif_twice_in_ifd", "xmp_orientation",
                 "two_exif_blocks", "bad_dqt", "reserved_marker", "mpf_app2", "header_only", "twelve_bit_sof"):
        assert read_jpeg_header(v[name]) is None, name
    h = read_jpeg_header(v["exif_6"])
    assert (h.width, h.height, h.components, h.orientation) == (120, 80, 3, 6)
    assert read_jpeg_header(memoryview(v["gray"])).components == 1


@pytest.mark.parametrize("name", sorted(pillow_odd_variants()))
def test_headers_pillow_reads_its_own_way_get_pillows_answer(name):
    """Markers Pillow reads without a length (TEM, JPG, JPGn, SOI) or as a frame (DHP), blocks it
    fails on, an EXIF IFD0 it stops reading early and an orientation only in XMP: the reader
    declines (so the answer is Pillow's) for all but the well-formed EXIF blocks."""
    data, want = pillow_odd_variants()[name]
    fast, slow = both(Decode(), data)
    assert slow == want, "Pillow's own answer changed"
    assert fast == want
    assert (read_jpeg_header(data) is None) == (name not in ("exif_entry_inside_block", "xmp_and_exif_orientation"))


def test_every_photo_gets_pillows_answer():
    d = Decode()
    for p in PHOTOS:
        data = p.read_bytes()
        fast, slow = both(d, data)
        assert fast == slow, p.name


def test_pixel_limit_from_the_fast_reader():
    data = _jpeg(_photo((300, 200)))
    with pytest.raises(DecodeError, match="too many pixels"):
        Decode(max_pixels=300 * 200 - 1).header(data)
    assert Decode(max_pixels=300 * 200).header(data)[:2] == (300, 200)


def test_long_headers():
    """bytes are read to the first scan; other buffers only over their first 64 KiB (no copy
    of a whole file), past which Pillow answers."""
    big_app = b"x" * 65000
    data = _insert_app(_insert_app(_jpeg(_photo()), 0xED, big_app), 0xED, big_app)
    assert read_jpeg_header(data)[:2] == (120, 80)
    assert read_jpeg_header(memoryview(data)) is None
    for x in (data, memoryview(data)):
        fast, slow = both(Decode(), x)
        assert fast == slow and fast[:3] == (120, 80, True)
    # with an EXIF orientation past those 64 KiB (a Parquet cell is a buffer): still DALI's
    rotated = _insert_app(_insert_app(_jpeg(_photo(), exif=_exif(6)), 0xED, big_app), 0xED, big_app)
    assert rotated.index(b"Exif") > 65536 or read_jpeg_header(memoryview(rotated)) is None
    for x in (rotated, memoryview(rotated)):
        fast, slow = both(Decode(), x)
        assert fast == slow == Header(80, 120, True, False)


def test_random_byte_damage_never_disagrees_with_pillow():
    """Flip bytes in the header region of a JPEG with EXIF: the reader answers as Pillow or
    declines, never a different answer."""
    base = _jpeg(_photo(), exif=_exif(6))
    rng = np.random.default_rng(0)
    d = Decode()
    for _ in range(300):
        b = bytearray(base)
        for pos in rng.integers(2, 200, size=2):
            b[pos] = int(rng.integers(0, 256))
        fast, slow = both(d, bytes(b))
        assert fast == slow


def test_every_marker_with_common_block_prefixes_gets_pillows_answer():
    """A segment of each marker Pillow might meet before the scan (TEM, C0-FE), holding the start
    of a block Pillow parses (JFIF, Adobe, ICC, Photoshop, EXIF, MPF, XMP, a frame) cut at
    several lengths, inserted before the frame header and before the scan."""
    base = _jpeg(_photo())
    exif = _exif(6)
    blocks = [b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00", b"Adobe\x00\x64\x00\x00\x00\x00\x01",
              b"ICC_PROFILE\x00\x01\x01abc", b"Photoshop 3.0\x008BIM\x04\x04\x00\x00\x00\x00\x00\x02ab",
              exif, b"MPF\x00II*\x00\x08\x00\x00\x00", b"http://ns.adobe.com/xap/1.0/\x00<x/>", SOF_32x16]
    d = Decode()
    for marker in [0x01, *range(0xC0, 0xFF)]:
        if marker in (0xD9, 0xDA):
            continue
        for block in blocks:
            for cut in sorted({0, 4, 6, 7, 13, 14, 18, len(block)}):
                seg = bytes([0xFF, marker]) + struct.pack(">H", min(cut, len(block)) + 2) + block[:cut]
                for data in (base[:2] + seg + base[2:], _before_scan(base, seg)):
                    fast, slow = both(d, data)
                    assert fast == slow, (hex(marker), block[:12], cut)
