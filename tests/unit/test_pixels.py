"""feedgpu.exec.pixels: PIL RGB images <-> uint8 HWC arrays."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from feedgpu.exec.pixels import rgb_array, rgb_image


@pytest.mark.parametrize("h, w", [(1, 1), (3, 5), (224, 224), (256, 341), (700, 97), (0, 4)])
def test_rgb_array_equals_numpy_asarray_and_rgb_image_round_trips(h, w):
    a = np.random.default_rng(h * 1000 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    img = Image.fromarray(a, "RGB") if h and w else Image.new("RGB", (w, h))
    got = rgb_array(img)
    assert got.dtype == np.uint8 and got.shape == (h, w, 3)
    assert np.array_equal(got, np.asarray(img)) and np.array_equal(got, a)
    back = rgb_image(a)
    assert back.mode == "RGB" and back.size == (w, h) and np.array_equal(np.asarray(back), a)


def test_rgb_array_of_a_cropped_lazy_image():
    """Images whose memory is made on load (a crop, a decoded file) give their pixels too."""
    a = np.arange(40 * 30 * 3, dtype=np.uint8).reshape(40, 30, 3)
    img = Image.fromarray(a).crop((3, 4, 23, 34))
    assert np.array_equal(rgb_array(img), a[4:34, 3:23])
