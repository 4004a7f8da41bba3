"""Decode encoded images (JPEG, PNG, WebP, GIF, BMP, TIFF) to RGB uint8 with Pillow(-SIMD).

The format is found from the bytes, never from the file name. Rules for unusual inputs:

* EXIF orientation (tag 274) is applied by default (``exif_orientation=False`` opts out), with
  the same transposes as ``PIL.ImageOps.exif_transpose``.
* Gray, CMYK and YCCK JPEGs are converted with Pillow's ``convert("RGB")`` (Adobe inverted
  CMYK is handled by Pillow's JPEG plugin).
* Images with alpha (LA, RGBA, palette with tRNS) are composited onto ``background``: by
  default ``(124, 116, 104)``, the ImageNet mean pixel (0.485, 0.456, 0.406 x 255), so
  transparent areas become ~0 after ImageNet normalization.
* 16-bit images are scaled to 8 bit as ``round(v * 255 / 65535)`` (monotonic, no clipping).
* 32-bit integer images (Pillow mode ``I``) are scaled by their real range: ``round(v * 255 /
  M)`` with ``M`` the TIFF ``MaxSampleValue`` tag when present, else ``2**b - 1`` for the smallest
  ``b >= 16`` that holds the image's largest value (so a 20-bit image fills the 8-bit range and
  16-bit data scales as above). Negative values: skipped as ``"unsupported pixel format"``.
* Float images (mode ``F``, such as float TIFFs) are read as values in ``[0, 1]``:
  ``round(v * 255)``. Values outside ``[0, 1]`` or NaN (HDR or another range, which cannot be
  told from the file): skipped as ``"unsupported pixel format"``, never clipped.
* A JPEG whose image data holds a marker that cannot be there before its end marker (a file cut
  off and followed by another image, or by other data) is ``"corrupt"``
  (:func:`~feedgpu.stages.jpeg_header.scan_end_error`), on both engines: it is checked before
  decoding, so the DALI engine never decodes its half-broken pixels. Bytes after a JPEG's end
  marker (a motion photo's video) are ignored.
* Animated images give their first frame.
* An image with more than ``max_pixels`` pixels (default 89,478,485, Pillow's own
  ``MAX_IMAGE_PIXELS``) is rejected from its header, before any pixel is decoded.

Failures raise :class:`~feedgpu.errors.DecodeError` with reason ``"empty"``, ``"not an image"``,
``"unsupported pixel format"`` (above), ``"unsupported format"`` (an image format recognised from its bytes, such as WebP, AVIF, HEIC or a 12-bit JPEG,
that this PIL build cannot decode, or a compression it has no decoder for, such as LZW or JPEG
in a TIFF without libtiff: Pillow-SIMD is often built without libwebp or libtiff; see
``python -m PIL.report``), ``"too many pixels"``, ``"truncated"`` or ``"corrupt"``.
"""
from __future__ import annotations

import io
from typing import Annotated, Any, Literal, NamedTuple

import numpy as np
from PIL import Image, UnidentifiedImageError
from pydantic import BeforeValidator

from ..errors import ConfigError, DecodeError
from ..spec import ImageSpec
from .base import SampleStage
from .dct_scale import choose_scale, reduced_box, rows_needed
from .jpeg_header import frame_rows, has_eoi, jpeg_precision, read_jpeg_header, scan_end_error, with_rows
from .params import RGB, PositiveInt

IMAGENET_MEAN_PIXEL = (124, 116, 104)
PILLOW_MAX_PIXELS = 89_478_485
_EXIF_ORIENTATION = 0x0112
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
UNKNOWN_KEY = "?"
_ALPHA_MODES = {"LA", "La", "RGBA", "RGBa", "PA"}
#: ``reduce``'s values (see :class:`Decode`); YAML 1.1 reads a bare ``off`` as false, taken as "off"
Reduce = Annotated[Literal["auto", "off", "rows"], BeforeValidator(lambda v: "off" if v is False else v)]
#: ``reduce``'s default: the full decode's pixels (the choice against ``"auto"`` is measured in
#: bench/results/decode_quality.md)
DEFAULT_REDUCE = "rows"


class Decode(SampleStage):
    """Encoded bytes (or a PIL image / HWC uint8 array from a torch Dataset) -> PIL RGB image.

    Args:
        exif_orientation: apply the EXIF orientation tag (default True).
        max_pixels: largest width x height accepted (default 89,478,485).
        background: RGB colour transparent pixels are composited onto (default ImageNet mean).
        reduce: how much of a JPEG the Python engine decodes when the next stage resizes a
            window of the image (``random_resized_crop``, ``resize_center_crop``, ``resize``;
            :meth:`apply_window`). ``"rows"`` (the default): not the rows below the window
            (and the resampling filter's reach), with the pixels of a full decode to the bit.
            ``"auto"``: also at the largest DCT scale (1/2, 1/4, 1/8) that keeps the window at
            least the output size: less work on photos much larger than the output, pixels
            close to but not equal to a full decode's (bench/results/decode_quality.md).
            ``"off"``: the whole image at full size. The DALI engine decodes only the window,
            at full size, whatever this setting.
    """

    name = "decode"
    version = 2   # 2: wide-integer and float images scaled, cut JPEGs corrupt (cached outputs change)

    def __init__(self, exif_orientation: bool = True, max_pixels: PositiveInt = PILLOW_MAX_PIXELS,
                 background: RGB = IMAGENET_MEAN_PIXEL, reduce: Reduce = DEFAULT_REDUCE):
        if reduce not in ("auto", "off", "rows"):
            raise ConfigError(f"{self.name}: reduce must be 'rows', 'auto' or 'off', got {reduce!r}")
        self.reduce = reduce
        self.exif_orientation = bool(exif_orientation)
        self.max_pixels = int(max_pixels)
        self.background = tuple(int(c) for c in background)

    def explain_name(self) -> str:
        return self.name if self.reduce == DEFAULT_REDUCE else f"{self.name} (reduce={self.reduce})"

    def config(self) -> dict[str, Any]:
        return {"exif_orientation": self.exif_orientation, "max_pixels": self.max_pixels,
                "background": list(self.background), "reduce": self.reduce}

    def out_spec(self, spec: ImageSpec) -> ImageSpec:
        return ImageSpec(None, None, 3, "uint8", "HWC", "image")

    def apply(self, x: Any, rng=None) -> Image.Image:
        key = UNKNOWN_KEY  # the executor replaces it with the sample's key
        if isinstance(x, Image.Image):
            img = x
        elif isinstance(x, (bytes, bytearray, memoryview)):
            img = self._open(x, key)
        else:
            img = Image.fromarray(_as_hwc_uint8(x, key))
        w, h = img.size
        self._check_pixels(w, h, key)
        if img.format == "JPEG" and isinstance(x, (bytes, bytearray, memoryview)):
            _check_scan_end(x, key)   # after the pixel limit, as in header(): one reason on both engines
        return self._finish(img, key)

    def apply_window(self, x: Any, target) -> tuple[Image.Image, tuple, tuple[int, int]]:
        """Decode ``x`` for a stage that resizes a window of it: ``target(width, height)`` (the
        upright size) gives ``(box, (out_w, out_h))``, the window (``(left, top, right, bottom)``
        float pixels) and the size it is resized to. Returns ``(image, box, (out_w, out_h))``
        with ``box`` the same window in the returned image.

        With ``reduce="off"``, or for anything but JPEG bytes, the image is :meth:`apply`'s and
        the box ``target``'s. Otherwise a JPEG that ends with its end marker is decoded down to
        the last row the resize reads (:func:`~feedgpu.stages.dct_scale.rows_needed`; a frame
        header giving fewer rows, :func:`~feedgpu.stages.jpeg_header.frame_rows`), and with
        ``reduce="auto"`` at the largest DCT scale (1/2, 1/4, 1/8) whose reduced window is still
        at least the output size (:func:`~feedgpu.stages.dct_scale.choose_scale`); the box is
        moved into that image. With ``"rows"`` the resized window is the full decode's to the
        bit. Raises :class:`DecodeError` as :meth:`apply` does, for the same inputs."""
        jpeg_bytes = isinstance(x, (bytes, bytearray, memoryview))
        if self.reduce == "off" or not jpeg_bytes:
            img = self.apply(x)
            box, out = target(img.width, img.height)
            return img, box, out
        key = UNKNOWN_KEY
        fast = self._window_header(x, key)
        if fast is not None:   # a common JPEG: opened once below, on the bytes it is decoded from
            img, (w, h, orientation) = None, fast
        else:
            img = self._open(x, key)
            w, h = img.size
            self._check_pixels(w, h, key)
            orientation = None
            if img.format == "JPEG":
                _check_scan_end(x, key)
                orientation = self._jpeg_orientation(img)
            if orientation is None:   # not a JPEG, or an EXIF block _finish() decides about
                img = self._finish(img, key)
                box, out = target(img.width, img.height)
                return img, box, out
        uw, uh = (h, w) if orientation in (5, 6, 7, 8) else (w, h)
        box, out = target(uw, uh)
        scale = choose_scale(box, *out) if self.reduce == "auto" else 1
        rows = h
        # rows are left out only where the box keeps its coordinates (the missing rows are at the
        # upright image's bottom or right): a box moved by whole pixels can resample differently
        # in the last bit. A file cut short is decoded whole, as apply() decodes it.
        frame = frame_rows(x) if orientation in (1, 2, 5, 8) and has_eoi(x) else None
        if frame is not None:
            need = rows_needed(box, *out, uw, uh, orientation, scale, 8 * frame[1])
            if need < h:   # the rows below the window are never decoded
                rows = need
                img = self._open(with_rows(x, frame[0], rows), key)
        if img is None:
            img = self._open(x, key)
        if scale > 1 and img.draft(None, (w // scale, rows // scale)) is None:
            scale = 1
        if scale > 1 or rows < h:
            if img.size != (-(-w // scale), -(-rows // scale)):   # cannot happen: draft picks `scale` itself
                raise AssertionError(f"decoding {w}x{h} at 1/{scale}, {rows} rows, gave {img.size}")
            box = reduced_box(box, uw, uh, orientation, scale, rows)
        return self._finish(img, key), box, out

    def _window_header(self, x, key: str) -> tuple[int, int, int] | None:
        """``(stored width, stored height, EXIF orientation)`` of a JPEG that ends with its end
        marker, read from its markers alone (:func:`read_jpeg_header`, whose answers are
        Pillow's), after the checks :meth:`apply_window` makes on an opened image, in the same
        order (the pixel limit, then the scan's end); None where the reader does not answer, to
        open the image with Pillow."""
        head = read_jpeg_header(x) if has_eoi(x) else None
        if head is None:
            return None
        w, h = head.width, head.height
        limit = Image.MAX_IMAGE_PIXELS
        if limit and w * h > 2 * limit:
            return None   # Pillow's open raises DecompressionBombError: its reason, its message
        self._check_pixels(w, h, key)
        _check_scan_end(x, key)
        return w, h, head.orientation if self.exif_orientation else 1

    def _jpeg_orientation(self, img: Image.Image) -> int | None:
        """The EXIF orientation :meth:`_finish` applies to an opened JPEG (1 when it applies
        none), read from the header; None when reading it raises (``_finish`` then decides)."""
        if not self.exif_orientation:
            return 1
        try:
            value = img.getexif().get(_EXIF_ORIENTATION, 1)
        except Exception:  # noqa: BLE001 - a broken EXIF block: _finish() meets it as apply() does
            return None
        return value if value in _TRANSPOSE else 1

    def _finish(self, img: Image.Image, key: str) -> Image.Image:
        """Load an opened image's pixels, apply its EXIF orientation and convert it to RGB."""
        try:
            img.load()
        except OSError as e:
            msg = str(e)
            if msg.startswith("decoder ") and msg.endswith(" not available"):
                # a compression this PIL build has no decoder for (LZW or JPEG-in-TIFF without libtiff)
                raise DecodeError(key, "unsupported format", f"{img.format} {msg} (python -m PIL.report lists "
                                  "the decoders of this build)") from None
            reason = "truncated" if "truncated" in msg.lower() else "corrupt"
            raise DecodeError(key, reason, msg) from None
        except (SyntaxError, ValueError, EOFError) as e:
            raise DecodeError(key, "corrupt", str(e)) from None
        if self.exif_orientation:
            method = _TRANSPOSE.get(img.getexif().get(_EXIF_ORIENTATION, 1))
            if method is not None:
                img = img.transpose(method)
        return self._to_rgb(img, key)

    def torch_baseline(self) -> list:
        """``ImageFolder``'s ``pil_loader`` (plus the EXIF transpose when this stage applies it)."""
        from ..torch_ref import LoadImage

        return [LoadImage(self.exif_orientation, _TRANSPOSE)]

    has_dali = True
    #: JPEG modes DALI decodes the way this stage does (CMYK/YCCK, PNG alpha, 16-bit ... do not
    #: go to DALI: their rules above are Pillow's, so Pillow decodes them and they rejoin the batch).
    DALI_JPEG_MODES = ("RGB", "L")

    def probe(self, data) -> tuple[int, int, bool]:
        """Read the header only: ``(width, height, dali_ok)`` with EXIF orientation applied to the
        size. Raises :class:`DecodeError` for empty, unidentifiable or too large images, so such
        samples are never sent to DALI."""
        return self.header(data)[:3]

    def header(self, data) -> "Header":
        """:meth:`probe`, and whether the stored pixels are upright (no EXIF rotation or mirror
        to apply), so a window of the output is the same window of the stored image (what
        decoding only a window, :meth:`dali_window`, needs). Common JPEGs are read by
        :func:`~feedgpu.stages.jpeg_header.read_jpeg_header`, the rest by Pillow. DALI takes a
        JPEG only if its orientation is none or a plain EXIF tag: one Pillow finds in an XMP
        block or an EXIF block the marker reader declines is decoded by Pillow (``dali_ok``
        False), as DALI's own EXIF reading (``adjust_orientation``) could differ."""
        marks = read_jpeg_header(data) if len(data) else None
        fast = self._jpeg_header(data, marks)
        if fast is not None:
            _check_scan_end(data, UNKNOWN_KEY)
            return fast
        img = self._open(data, UNKNOWN_KEY)
        w, h = img.size
        self._check_pixels(w, h, UNKNOWN_KEY)
        if not (img.format == "JPEG" and img.mode in self.DALI_JPEG_MODES and has_eoi(data)):
            # decoded by :meth:`apply`, which finds the size and the errors itself (a PNG's
            # getexif() would decode the whole image here, and raise OSError if it is truncated)
            return Header(w, h, False, False)
        orientation = 1
        if self.exif_orientation:
            try:
                orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
            except Exception:  # noqa: BLE001 - a broken EXIF block: let apply() decide
                return Header(w, h, False, False)
            if orientation in (5, 6, 7, 8):
                w, h = h, w
            if ("exif" in img.info or orientation not in (1, None)) and (
                    marks if isinstance(data, bytes) else read_jpeg_header(bytes(data))) is None:
                # an orientation DALI's decoder may read otherwise (it reads EXIF, not XMP, and
                # not every EXIF layout as Pillow): Pillow decodes it, as the Python engine does
                # (bytes: a buffer's header past 64 KiB is read too)
                return Header(w, h, False, orientation in (1, None))
        _check_scan_end(data, UNKNOWN_KEY)
        return Header(w, h, True, orientation in (1, None))

    def _check_pixels(self, w: int, h: int, key: str) -> None:
        if w * h > self.max_pixels:
            raise DecodeError(key, "too many pixels", f"{w}x{h} > max_pixels={self.max_pixels}")

    def _jpeg_header(self, data, head) -> "Header | None":
        """:meth:`header` from the markers alone (``head``: what :func:`read_jpeg_header` read
        from ``data``), when the reader answered and the file ends with its EOI marker; None to
        ask Pillow."""
        if head is None or not has_eoi(data):
            return None
        w, h = head.width, head.height
        limit = Image.MAX_IMAGE_PIXELS
        if limit and w * h > 2 * limit:
            return None   # Pillow raises DecompressionBombError: the same reason, its message
        self._check_pixels(w, h, UNKNOWN_KEY)
        orientation = head.orientation if self.exif_orientation else 1
        if orientation in (5, 6, 7, 8):
            w, h = h, w
        return Header(w, h, True, orientation == 1)

    def dali_window(self, x, start, end, args, device):
        """Decode only the window ``[start, end)`` (int32 ``(y, x)`` pixels per sample) of upright
        JPEGs: libjpeg-turbo (CPU) or nvJPEG (``device="gpu"``) skip the rows and blocks outside it.
        Output uint8 HWC RGB of the window's size."""
        from nvidia.dali import fn, types

        kw = {"hw_decoder_load": args["hw_decoder_load"]} if device == "gpu" else {}
        return fn.decoders.image_slice(x, start=start, end=end, axis_names="HW",
                                       device="mixed" if device == "gpu" else "cpu", output_type=types.RGB,
                                       adjust_orientation=False, **kw)

    def dali(self, x, args, device):
        """``x``: encoded bytes. ``device="gpu"`` decodes with ``device="mixed"`` (nvJPEG and the
        hardware JPEG decoder, share set by ``args["hw_decoder_load"]``)."""
        from nvidia.dali import fn, types

        kw = {"hw_decoder_load": args["hw_decoder_load"]} if device == "gpu" else {}
        return fn.decoders.image(x, device="mixed" if device == "gpu" else "cpu", output_type=types.RGB,
                                 adjust_orientation=self.exif_orientation, **kw)

    @staticmethod
    def _open(data, key: str) -> Image.Image:
        if len(data) == 0:
            raise DecodeError(key, "empty")
        try:
            return Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            fmt = sniff_format(data)
            precision = jpeg_precision(data)
            if precision not in (None, 8):
                raise DecodeError(key, "unsupported format", f"{precision}-bit JPEG: Pillow decodes 8-bit "
                                  "JPEGs only") from None
            if fmt is not None:
                raise DecodeError(key, "unsupported format", f"{fmt}: this PIL build cannot decode it "
                                  "(python -m PIL.report lists the supported formats)") from None
            raise DecodeError(key, "not an image") from None
        except Image.DecompressionBombError as e:
            raise DecodeError(key, "too many pixels", str(e)) from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise DecodeError(key, "corrupt", str(e)) from None

    def _to_rgb(self, img: Image.Image, key: str = UNKNOWN_KEY) -> Image.Image:
        mode = img.mode
        if mode == "RGB":
            return img
        if mode in ("I;16", "I;16B", "I;16L", "I;16N"):
            a = np.asarray(img).astype(np.uint32)
            a8 = ((np.clip(a, 0, 65535) * 255 + 32767) // 65535).astype(np.uint8)
            return Image.fromarray(a8, "L").convert("RGB")
        if mode in ("I", "F"):
            return Image.fromarray(_wide_to_8bit(img, key), "L").convert("RGB")
        if mode == "P" and "transparency" in img.info:
            img, mode = img.convert("RGBA"), "RGBA"
        if mode in _ALPHA_MODES:
            rgba = img.convert("RGBA")
            out = Image.new("RGB", img.size, self.background)
            out.paste(rgba.convert("RGB"), mask=rgba.getchannel("A"))
            return out
        return img.convert("RGB")


_FTYP_BRANDS = {b"avif": "AVIF", b"avis": "AVIF", b"heic": "HEIC", b"heix": "HEIC", b"hevc": "HEIC",
                b"mif1": "HEIF", b"msf1": "HEIF"}


def sniff_format(data) -> str | None:
    """The name of an image format recognised from its first bytes (WebP, AVIF, HEIC/HEIF,
    JPEG XL, JPEG 2000), or None. Used to tell "an image this PIL build cannot decode" from
    "not an image"."""
    head = bytes(data[:32])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    if head[4:8] == b"ftyp" and head[8:12] in _FTYP_BRANDS:
        return _FTYP_BRANDS[head[8:12]]
    if head[:2] == b"\xff\x0a" or head[:12] == b"\x00\x00\x00\x0cJXL \r\n\x87\n":
        return "JPEG XL"
    if head[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n" or head[:4] == b"\xff\x4f\xff\x51":
        return "JPEG 2000"
    return None


class Header(NamedTuple):
    """What :meth:`Decode.header` reads: the size after EXIF orientation, whether DALI's JPEG
    decoder takes the file, and whether its stored pixels need no rotation."""

    width: int
    height: int
    dali_ok: bool
    upright: bool


def _check_scan_end(data, key: str) -> None:
    message = scan_end_error(data)
    if message is not None:
        raise DecodeError(key, "corrupt", message)


def _wide_to_8bit(img: Image.Image, key: str) -> np.ndarray:
    """A mode ``I`` (int32) or ``F`` (float32) image as uint8, by the rules in the module
    docstring; :class:`DecodeError` ``"unsupported pixel format"`` where they do not apply."""
    a = np.asarray(img)
    if img.mode == "F":
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
        if not np.isfinite(a).all() or lo < 0.0 or hi > 1.0:
            raise DecodeError(key, "unsupported pixel format", f"float pixels in [{lo:g}, {hi:g}]; float images "
                              "are read as values in [0, 1]")
        return np.rint(a.astype(np.float64) * 255.0).astype(np.uint8)
    a = a.astype(np.int64)
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    if lo < 0:
        raise DecodeError(key, "unsupported pixel format", f"integer pixels in [{lo}, {hi}]: negative values")
    top = 0
    tags = getattr(img, "tag_v2", None)
    if tags is not None:
        v = tags.get(281)   # MaxSampleValue
        v = v[0] if isinstance(v, tuple) and v else v
        top = int(v) if isinstance(v, int) and v > 0 else 0
    if top <= 0 or hi > top:
        top = (1 << max(16, hi.bit_length())) - 1
    return ((a * 255 + top // 2) // top).astype(np.uint8)


def _as_hwc_uint8(x, key: str) -> np.ndarray:
    a = x.numpy() if hasattr(x, "numpy") else np.asarray(x)
    if a.dtype != np.uint8 or a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (1, 3, 4)):
        raise DecodeError(key, "not an image", f"array of shape {a.shape} and dtype {a.dtype}; "
                          "expected HWC uint8 with 1, 3 or 4 channels")
    return a[:, :, 0] if a.ndim == 3 and a.shape[2] == 1 else a
