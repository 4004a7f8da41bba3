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

from ..stages.jpeg_header import frame_rows, with_rows

__all__ = ["load_rgb", "load_window", "read_bytes"]


def read_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def load_rgb(path) -> Image.Image:
    """torchvision's ``pil_loader`` (the file opened with PIL, ``convert("RGB")``), the file read
    in one call (PIL reads an open file in many small pieces) and without the copy ``convert``
    makes of an image that is RGB already: the same pixels."""
    return _rgb(Image.open(io.BytesIO(read_bytes(path))))


def _rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        img.load()
        return img
    return img.convert("RGB")


def _has_eoi(data: bytes) -> bool:
    """The file ends with a JPEG end-of-image marker (within its last KiB: trailing data after it
    is allowed, as libjpeg ignores it)."""
    return data.rfind(b"\xff\xd9", max(0, len(data) - 1024)) != -1


def load_window(path, op, u) -> Image.Image:
    """``op`` (a :class:`~feedgpu.torchvision.ops.RandomResizedCropOp`) applied with draws
    ``u`` to ``pil_loader(path)``: the window drawn from the stored image's size (what
    ``pil_loader`` gives: torchvision applies no EXIF orientation), the JPEG decoded down to the
    window's last row plus one row of MCUs, the window cropped and resized. The same pixels as
    ``op.apply(pil_loader(path), u)``; the same errors for files PIL cannot open or decode."""
    data = read_bytes(path)
    img = Image.open(io.BytesIO(data))
    width, height = img.size
    window = op.window(width, height, u)
    if img.format == "JPEG":
        frame = frame_rows(data)
        if frame is not None and _has_eoi(data):
            rows = window[0] + window[2] + 8 * frame[1]
            if rows < height:
                img = Image.open(io.BytesIO(with_rows(data, frame[0], rows)))
    return op.crop(_rgb(img), window)
