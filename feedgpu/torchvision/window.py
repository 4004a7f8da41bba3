"""torchvision's ``pil_loader`` for a recipe that starts with ``RandomResizedCrop``: the file is
opened, the crop window drawn from the image's size, and a JPEG decoded only down to the rows
the window needs.

torchvision's ``resized_crop`` on a PIL image crops the window and resizes the crop, so it reads
no pixel below the window's last row. libjpeg given the same file with a smaller height in its
frame header (:func:`~feedgpu.stages.jpeg_header.with_rows`) decodes the first rows only, each
of them the full decode's to the bit except the last row of MCUs, whose chroma upsampling lacks
the row below (:func:`~feedgpu.stages.jpeg_header.frame_rows`): one more row of MCUs is decoded
and left unused. The window is cut from an image of the same width, at the same place, so the
sample is the one torchvision makes from the whole decoded image, pixel for pixel.

Anything else (not a JPEG, a JPEG whose frame header this cannot rewrite, a file without its end
marker: a truncated one, which PIL must fail on as it does for torch's loader) is decoded whole,
as ``pil_loader`` does.
"""
from __future__ import annotations

import io

from PIL import Image

from ..stages.jpeg_header import frame_rows, has_eoi, with_rows

__all__ = ["load_rgb", "load_window", "pil_loader", "read_bytes"]


def read_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pil_loader(path) -> Image.Image:
    """torchvision's ``pil_loader`` as it is: what the fast paths fall back to when they fail, so
    that a bad file raises the error (type and message, naming the file) torch's loader raises."""
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


def load_rgb(path) -> Image.Image:
    """torchvision's ``pil_loader`` (the file opened with PIL, ``convert("RGB")``), the file read
    in one call (PIL reads an open file in many small pieces) and without the copy ``convert``
    makes of an image that is RGB already: the same pixels. A file that fails is read again by
    :func:`pil_loader`, which raises torch's error."""
    try:
        return _rgb(Image.open(io.BytesIO(read_bytes(path))))
    except Exception:  # noqa: BLE001 - pil_loader raises what torch's loader raises
        return pil_loader(path)


def _rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        img.load()
        return img
    return img.convert("RGB")


def load_window(path, op, u) -> Image.Image:
    """``op`` (a :class:`~feedgpu.torchvision.ops.RandomResizedCropOp`) applied with draws
    ``u`` to ``pil_loader(path)``: the window drawn from the stored image's size (what
    ``pil_loader`` gives: torchvision applies no EXIF orientation), the JPEG decoded down to the
    window's last row plus one row of MCUs, the window cropped and resized. The same pixels as
    ``op.apply(pil_loader(path), u)``; a file that fails is read again by :func:`pil_loader`, so
    the errors are torch's."""
    try:
        return _load_window(path, op, u)
    except Exception:  # noqa: BLE001 - pil_loader raises what torch's loader raises
        return op.apply(pil_loader(path), u)


def _load_window(path, op, u) -> Image.Image:
    data = read_bytes(path)
    img = Image.open(io.BytesIO(data))
    width, height = img.size
    window = op.window(width, height, u)
    if img.format == "JPEG":
        frame = frame_rows(data)
        if frame is not None and has_eoi(data):
            rows = window[0] + window[2] + 8 * frame[1]
            if rows < height:
                img = Image.open(io.BytesIO(with_rows(data, frame[0], rows)))
    return op.crop(_rgb(img), window)
