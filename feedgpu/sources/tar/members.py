"""The members of a tar shard as :class:`~feedgpu.sources.tar.TarShardSource` sees them: the
WebDataset key rule (:func:`split_member`, the field kinds; described in :mod:`feedgpu.sources.tar.source`),
a member's header facts, its label, and a shard's part of the index as arrays."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..extensions import IMAGE_FIELDS

IMAGE_SUFFIXES = IMAGE_FIELDS   # the folder source's image endings, without the dot
LABEL_SUFFIXES = ("cls.txt", "cls", "label")
OTHER_LABEL_FIELDS = ("json", "txt", "id", "class", "target")   # WebDataset fields some writers label with
COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")
_LABEL_BYTES = 64
_MAX_LABEL = np.iinfo(np.int64).max   # labels are held as int64


def split_member(name: str) -> tuple[str | None, str]:
    """WebDataset's rule: ``(key, field)`` with the key up to the first dot of the base name and
    the field after it, lower-cased; ``(None, "")`` for a base name without a dot or starting
    with one (WebDataset skips such members)."""
    head, slash, base = name.rpartition("/")
    stem, dot, field = base.partition(".")
    if not dot or not stem:
        return None, ""
    return head + slash + stem, field.lower()


def field_kind(field: str) -> tuple[str | None, str]:
    """``("label" | "image" | None, qualifier)`` of a member's field."""
    for suffix in LABEL_SUFFIXES:
        if field == suffix:
            return "label", ""
        if field.endswith("." + suffix):
            return "label", field[:-len(suffix) - 1]
    qual, _, last = field.rpartition(".")
    if last in IMAGE_SUFFIXES:
        return "image", qual
    return None, ""


class Member(NamedTuple):
    name: str
    offset: int
    size: int
    cut: bool          # the shard ends inside its data


def part_arrays(part: dict) -> dict:
    """A shard's part with its members as arrays (``blob`` of the names, ``lens``, ``offsets``,
    ``sizes``, ``labels``), as :func:`feedgpu.sources.tar.scan.scan_plain` and a saved index give it."""
    if "blob" in part:
        return part
    encoded = [m.encode("utf-8", "surrogateescape") for m in part["members"]]
    out = {k: v for k, v in part.items() if k not in ("members", "offsets", "sizes", "labels")}
    from .scan import narrow

    out.update(blob=np.frombuffer(b"".join(encoded), dtype=np.uint8),
               lens=narrow(np.array([len(b) for b in encoded], dtype=np.int64)),
               offsets=narrow(np.asarray(part["offsets"], dtype=np.int64)),
               sizes=narrow(np.asarray(part["sizes"], dtype=np.int64)), labels=np.asarray(part["labels"], dtype=np.int64))
    return out


def read_label(raw, m: Member) -> int | None:
    """The integer a label member holds (ASCII digits, blanks around), or None."""
    if m.size > _LABEL_BYTES:
        return None
    raw.seek(m.offset)
    text = raw.read(m.size).decode("ascii", "replace").strip()
    if not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= _MAX_LABEL else None
