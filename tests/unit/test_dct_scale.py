"""The DCT scale choice and the window's box through EXIF orientation (feedgpu.stages.dct_scale)."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from feedgpu.stages.decode import _TRANSPOSE
from feedgpu.stages.dct_scale import DCT_SCALES, choose_scale, reduced_box, to_stored, to_upright


def test_choose_scale_never_upscales_and_takes_the_largest():
    rng = np.random.default_rng(0)
    for _ in range(5000):
        left, top = rng.uniform(0, 500, 2)
        w, h = rng.uniform(1, 4000, 2)
        ow, oh = (int(v) for v in rng.integers(1, 600, 2))
        s = choose_scale((left, top, left + w, top + h), ow, oh)
        assert s in DCT_SCALES
        assert s == 1 or (w / s >= ow and h / s >= oh)          # the reduced window is never enlarged
        bigger = [t for t in DCT_SCALES if t > s]
        assert all(w / t < ow or h / t < oh for t in bigger)   # no larger scale would keep the size


@pytest.mark.parametrize("box, out, want", [
    ((0, 0, 1600, 1000), (224, 224), 4),        # 400x250 >= 224, 200x125 is not
    ((0, 0, 896, 448), (224, 224), 2),          # exactly twice the output both ways
    ((0, 0, 895.9, 448), (224, 224), 2),
    ((0, 0, 447.9, 2000), (224, 224), 1),       # below twice the output one way: full size
    ((10, 10, 10 + 224 * 8, 10 + 224 * 8), (224, 224), 8),
    ((0, 0, 5, 5), (224, 224), 1),              # smaller than the output: full size, as torchvision
])
def test_choose_scale_examples(box, out, want):
    assert choose_scale(box, *out) == want


@pytest.mark.parametrize("orientation", range(1, 9))
def test_boxes_follow_the_exif_transposes(orientation):
    """A box cut from the stored pixels and then oriented equals the mapped box cut from the
    oriented pixels, for Pillow's transposes (odd sizes, random integer boxes)."""
    rng = np.random.default_rng(orientation)
    W, H = 37, 23
    stored = Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8))
    method = _TRANSPOSE.get(orientation)
    upright = stored.transpose(method) if method is not None else stored
    for _ in range(50):
        x0, x1 = sorted(rng.choice(W + 1, 2, replace=False))
        y0, y1 = sorted(rng.choice(H + 1, 2, replace=False))
        box = (x0, y0, x1, y1)
        up = to_upright(box, W, H, orientation)
        part = stored.crop(box)
        part = part.transpose(method) if method is not None else part
        assert np.array_equal(np.asarray(part), np.asarray(upright.crop(tuple(int(v) for v in up))))
        assert to_stored(up, *upright.size, orientation) == box


def test_reduced_box_scales_the_stored_grid():
    # upright, no partial pixel: a plain division
    assert reduced_box((100, 50, 900, 650), 1600, 1000, 1, 4) == (25, 12.5, 225, 162.5)
    # 180 degrees, 1601 wide at 1/2: the reduced image is 801 wide and its partial last column
    # (stored x 1600) comes first once rotated: upright x maps to (x + 1) / 2
    assert reduced_box((0, 0, 1601, 1001), 1601, 1001, 3, 2) == (0.5, 0.5, 801.0, 501.0)
    # orientation 6 (a 90 degree turn): the stored image is 1601 x 1001, upright 1001 x 1601
    box = reduced_box((0, 0, 1001, 1601), 1001, 1601, 6, 2)
    assert box == (0.5, 0.0, 501.0, 800.5)


def _jpeg(mode="RGB", size=(64, 40), **kw) -> bytes:
    import io

    buf = io.BytesIO()
    Image.new(mode, size, "white" if mode != "CMYK" else (0, 0, 0, 0)).save(buf, "JPEG", **kw)
    return buf.getvalue()


@pytest.mark.parametrize("kw, vmax", [({}, 2), ({"subsampling": 0}, 1), ({"progressive": True}, 2),
                                      ({"subsampling": 1}, 1)])
def test_frame_rows_finds_the_height_field(kw, vmax):
    import io

    from feedgpu.stages.jpeg_header import frame_rows, with_rows

    data = _jpeg(**kw)
    offset, v = frame_rows(data)
    assert v == vmax and int.from_bytes(data[offset:offset + 2], "big") == 40
    assert Image.open(io.BytesIO(with_rows(data, offset, 17))).size == (64, 17)


def test_frame_rows_declines_what_it_does_not_handle():
    from pathlib import Path

    from feedgpu.stages.jpeg_header import frame_rows

    data_dir = Path(__file__).resolve().parents[1] / "data"
    assert frame_rows((data_dir / "arithmetic.jpg").read_bytes()) is None   # SOF9: arithmetic coding
    assert frame_rows(b"") is None and frame_rows(b"\x89PNG\r\n\x1a\n") is None
    cut = _jpeg()[:20]
    assert frame_rows(cut) is None


def test_rows_needed_covers_the_box_and_the_filter_reach():
    from feedgpu.stages.dct_scale import rows_needed

    # upright, scale 1, a 448 px high box to 224: reach 3 * 2 + 2 px, plus one MCU row
    assert rows_needed((0, 100, 448, 548), 224, 224, 1600, 1000, 1, 1, 16) == 548 + 8 + 16
    # orientation 8 (stored rows are upright columns): the box's right edge decides
    assert rows_needed((100, 0, 300, 900), 224, 224, 1000, 1600, 8, 1, 8) == 300 + 5 + 8
    # at 1/4 the reach is counted in reduced pixels
    assert rows_needed((0, 0, 1600, 1000), 224, 224, 1600, 1000, 1, 4, 16) >= 1000 + 4 * 3
