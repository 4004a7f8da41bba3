"""PIL RGB images <-> uint8 HWC arrays with one copy each way, and :class:`Pixels`, one image
held in whichever of the two forms it already has.

PIL keeps an RGB image as 4 bytes per pixel (RGBX), so any exchange with 3-byte pixels packs or
unpacks. ``np.asarray(img)`` goes through ``img.tobytes()``, which packs into 64 KiB chunks and
then joins them (a second copy, and fresh memory for every chunk); :func:`rgb_array` packs the
whole image in one encoder call into one ``bytes`` object and shares it.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

__all__ = ["Pixels", "batch_row", "rgb", "rgb_array", "rgb_image"]


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
    """A PIL RGB image of uint8 (height, width, 3) ``pixels`` (one unpacking copy; a
    non-contiguous view, such as a flipped one, is made contiguous first). The image memory is
    not cleared first, as ``Image.frombuffer``/``Image.frombytes`` do; for RGB those copy too
    (only RGBX/RGBA/L... buffers can be shared)."""
    h, w = pixels.shape[:2]
    im = Image.new("RGB", (w, h), None)
    im.frombytes(np.ascontiguousarray(pixels))
    return im


def rgb(x: Any) -> Any:
    """``x`` converted to RGB when it is a PIL image in another mode, else ``x`` itself."""
    return x.convert("RGB") if isinstance(x, Image.Image) and x.mode != "RGB" else x


class Pixels:
    """One RGB image as a PIL image, a uint8 (height, width, 3) array, or both (the same
    pixels). A form it lacks is made when first asked for, once, and kept.

    The pixel cache hands samples on as ``Pixels`` (a hit: the cached array only; a miss: the
    image the stages made and the array stored), so a stage that takes arrays, and the batch
    writer, get the array as it is, and a stage that needs PIL gets the image without a copy
    when there is one.

    Args:
        image: a PIL image (any mode: :meth:`array` converts to RGB first), or None.
        array: uint8 (height, width, 3) RGB pixels (any strides), or None. One of the two is
            required.
    """

    __slots__ = ("_image", "_array")

    def __init__(self, image: Image.Image | None = None, array: np.ndarray | None = None):
        if image is None and array is None:
            raise ValueError("Pixels needs an image or an array")
        self._image, self._array = image, array

    @property
    def has_array(self) -> bool:
        return self._array is not None

    def image(self) -> Image.Image:
        """The PIL image (an RGB one unpacked from the array when there was none)."""
        if self._image is None:
            self._image = rgb_image(self._array)
        return self._image

    def array(self) -> np.ndarray:
        """The uint8 (height, width, 3) pixels (packed from the image, in RGB, when there were none)."""
        if self._array is None:
            self._array = rgb_array(rgb(self._image))
        return self._array

    def either(self) -> Image.Image | np.ndarray:
        """What a stage that takes both forms gets: the array when there is one, else the image."""
        return self._array if self._array is not None else self._image


def batch_row(x: Any) -> np.ndarray:
    """The array the batch writer gets for a sample the stages left as ``x``: a :class:`Pixels`'
    array, a PIL image's RGB pixels (:func:`rgb_array`), or ``np.asarray(x)``."""
    if isinstance(x, Pixels):
        return x.array()
    x = rgb(x)
    return rgb_array(x) if isinstance(x, Image.Image) else np.asarray(x)
