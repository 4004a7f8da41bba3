"""PIL RGB images <-> uint8 HWC arrays with one copy each way.

PIL keeps an RGB image as 4 bytes per pixel (RGBX), so any exchange with 3-byte pixels packs or
unpacks. ``np.asarray(img)`` goes through ``img.tobytes()``, which packs into 64 KiB chunks and
then joins them (a second copy, and fresh memory for every chunk); :func:`rgb_array` packs the
whole image in one encoder call into one ``bytes`` object and shares it.
"""
from __future__ import annotations

import numpy as np
from PIL import Image


def rgb_array(img: Image.Image) -> np.ndarray:
    """The pixels of an RGB ``img`` as a read-only uint8 array of shape (height, width, 3) over
    one ``bytes`` object; equal to ``np.asarray(img)``."""
    w, h = img.size
    n = w * h * 3
    if n == 0:
        return np.zeros((h, w, 3), np.uint8)
    img.load()
    enc = Image._getencoder("RGB", "raw", ("RGB",))
    enc.setimage(img.im)
    _, status, data = enc.encode(n)
    if status != 1 or len(data) != n:  # pragma: no cover - the raw encoder packs a whole buffer in one call
        data = img.tobytes()
    return np.frombuffer(data, np.uint8).reshape(h, w, 3)


def rgb_image(pixels: np.ndarray) -> Image.Image:
    """A PIL RGB image of uint8 (height, width, 3) ``pixels`` (one unpacking copy). The image
    memory is not cleared first, as ``Image.frombuffer``/``Image.frombytes`` do; for RGB those
    copy too (only RGBX/RGBA/L... buffers can be shared)."""
    h, w = pixels.shape[:2]
    im = Image.new("RGB", (w, h), None)
    im.frombytes(pixels)
    return im
