"""What flows between stages: shapes, dtypes and layouts, declared before any data flows."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ImageSpec:
    """The spec of one image sample.

    Attributes:
        height, width: pixels, or ``None`` while the size still depends on the input.
        channels: 3 for RGB.
        dtype: ``"uint8"``, ``"float32"`` or ``"float16"``.
        layout: ``"HWC"`` or ``"CHW"``.
        kind: ``"bytes"`` before decode, ``"image"`` after.
    """

    height: int | None = None
    width: int | None = None
    channels: int = 3
    dtype: str = "uint8"
    layout: str = "HWC"
    kind: str = "image"

    @property
    def fixed(self) -> bool:
        return self.height is not None and self.width is not None

    @property
    def shape(self) -> tuple:
        h, w, c = self.height, self.width, self.channels
        return (c, h, w) if self.layout == "CHW" else (h, w, c)

    def with_(self, **kw) -> "ImageSpec":
        return replace(self, **kw)

    def describe(self) -> str:
        if self.kind == "bytes":
            return "encoded bytes"
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype} {self.layout} [{dims}]"


BYTES = ImageSpec(kind="bytes", height=None, width=None)
