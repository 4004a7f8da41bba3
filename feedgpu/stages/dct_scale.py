"""Reduced JPEG decode for a stage that resizes a window of the image: the DCT scale to decode
at, and the window's box mapped between the upright image and the stored (pre-EXIF) one.

libjpeg decodes a JPEG at 1/2, 1/4 or 1/8 of its size by scaling in the DCT domain (Pillow's
``Image.draft``): each 8x8 block gives 4x4, 2x2 or 1x1 pixels, so pixel ``i`` of the reduced
image covers stored pixels ``[i*s, (i+1)*s)`` and its last row and column may cover fewer
(reduced size ``ceil(size / s)``). The scale is chosen so that the window, reduced, is still at
least the output size in both directions: the resize after it never enlarges.

Boxes are ``(left, top, right, bottom)`` floats in pixels, as ``Image.resize(box=...)`` takes
them. EXIF orientations are the tag's values 1-8, with the transposes of
``PIL.ImageOps.exif_transpose``.
"""
from __future__ import annotations

import math

__all__ = ["DCT_SCALES", "choose_scale", "reduced_box", "rows_needed", "to_stored", "to_upright"]

#: the DCT scale denominators libjpeg decodes at, largest first (1: full size)
DCT_SCALES = (8, 4, 2, 1)
_INVERSE = {6: 8, 8: 6}   # the other orientations are their own inverse


def choose_scale(box, out_w: int, out_h: int) -> int:
    """The largest of :data:`DCT_SCALES` whose reduced window is still at least ``out_w`` x
    ``out_h`` pixels: ``s`` with ``width / s >= out_w`` and ``height / s >= out_h``, ``width``
    and ``height`` the box's (full-size pixels). 1 when no reduction keeps that size."""
    left, top, right, bottom = box
    w, h = right - left, bottom - top
    for s in DCT_SCALES:
        if w >= out_w * s and h >= out_h * s:
            return s
    return 1


def to_upright(box, width: int, height: int, orientation: int) -> tuple[float, float, float, float]:
    """``box`` in the stored image (``width`` x ``height`` pixels, before EXIF orientation) ->
    the same region in the image after ``orientation`` is applied."""
    left, top, right, bottom = box
    w, h = width, height
    if orientation == 2:    # FLIP_LEFT_RIGHT
        return (w - right, top, w - left, bottom)
    if orientation == 3:    # ROTATE_180
        return (w - right, h - bottom, w - left, h - top)
    if orientation == 4:    # FLIP_TOP_BOTTOM
        return (left, h - bottom, right, h - top)
    if orientation == 5:    # TRANSPOSE: (x, y) -> (y, x)
        return (top, left, bottom, right)
    if orientation == 6:    # ROTATE_270 (clockwise): (x, y) -> (h - y, x)
        return (h - bottom, left, h - top, right)
    if orientation == 7:    # TRANSVERSE: (x, y) -> (h - y, w - x)
        return (h - bottom, w - right, h - top, w - left)
    if orientation == 8:    # ROTATE_90 (counter-clockwise): (x, y) -> (y, w - x)
        return (top, w - right, bottom, w - left)
    return (left, top, right, bottom)


def to_stored(box, width: int, height: int, orientation: int) -> tuple[float, float, float, float]:
    """``box`` in the upright image (``width`` x ``height`` pixels, after ``orientation``) -> the
    same region in the stored image."""
    return to_upright(box, width, height, _INVERSE.get(orientation, orientation))


def reduced_box(box, width: int, height: int, orientation: int, scale: int,
                rows: int | None = None) -> tuple[float, float, float, float]:
    """``box`` of the upright full-size image (``width`` x ``height``) -> the same region of the
    upright image decoded at ``1/scale`` from the first ``rows`` stored rows (default all): its
    stored size ``ceil(stored width / scale)`` x ``ceil(rows / scale)``, then oriented (where the
    orientation mirrors an axis, the partial last pixel or the missing rows come first)."""
    sw, sh = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
    left, top, right, bottom = to_stored(box, width, height, orientation)
    rw, rh = -(-sw // scale), -(-(sh if rows is None else rows) // scale)
    return to_upright((left / scale, top / scale, right / scale, bottom / scale), rw, rh, orientation)


def rows_needed(box, out_w: int, out_h: int, width: int, height: int, orientation: int, scale: int,
                mcu_rows: int) -> int:
    """The stored rows (from the top) a decode must give for ``box`` of the upright image
    (``width`` x ``height``) to be resized to ``out_w`` x ``out_h`` exactly as from the whole
    image at ``1/scale``: the box, widened by the reach of any of Pillow's resampling filters
    (support 3 at most, times the downscale factor, plus 2 pixels of rounding), mapped to the
    stored image, plus one row of MCUs (``mcu_rows`` pixels), whose upsampling needs the next."""
    left, top, right, bottom = box
    mx = scale * (3 * max(1.0, (right - left) / (scale * out_w)) + 2)
    my = scale * (3 * max(1.0, (bottom - top) / (scale * out_h)) + 2)
    stored = to_stored((left - mx, top - my, right + mx, bottom + my), width, height, orientation)
    return math.ceil(stored[3]) + mcu_rows
