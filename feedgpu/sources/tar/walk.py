"""A tar shard's part of the index through :mod:`tarfile`: any shard, damaged ones included.

:func:`index_with_tarfile` walks the shard's headers with :mod:`tarfile`, groups members by the key
rule and leaves out what cannot be delivered, with the reasons :mod:`feedgpu.sources.tar.source`
describes. It touches nothing but the shard (no source object), so shards can be indexed in
threads; the caller records the part's ``rejected`` entries.
"""
from __future__ import annotations

import os
import tarfile

from ...errors import SourceError
from .members import COMPRESSED_MAGIC, IMAGE_SUFFIXES, OTHER_LABEL_FIELDS, Member, field_kind, read_label, \
    split_member


class _Walk:
    """The records one shard left out (``rejected``: ``[key, reason, detail]``) and whether its
    end is damaged (``cut``: the last group may have lost members)."""

    def __init__(self):
        self.rejected: list[list[str]] = []
        self.cut = False

    def reject(self, key: str, reason: str, detail: str = "") -> None:
        self.rejected.append([key, reason, detail])


def index_with_tarfile(path: str, local: str) -> dict:
    """One shard's samples (``members``, ``offsets``, ``sizes``, ``labels``: -2 for none),
    whether it has label members (``labeled``), its ``other`` label-like members and the records
    it left out (``rejected``: ``[key, reason, detail]``, keys ``path:member``). ``path`` names the
    shard in keys, ``local`` is the file read. Raises :class:`SourceError` for a shard that is not
    a file, is compressed or is not a tar."""
    members, offsets, sizes, labels = [], [], [], []
    labeled, other_labels = False, 0
    groups: dict[str, dict] = {}
    walk = _Walk()
    last = None
    with open(local, "rb") as raw:
        for m in _members(walk, path, raw, local):
            key, field = split_member(m.name)
            if key is None:
                if m.name.lower().endswith(tuple("." + e for e in IMAGE_SUFFIXES)):
                    walk.reject(f"{path}:{m.name}", "no key", "its base name starts with a dot: "
                                "WebDataset readers skip it too")
                continue
            kind, qual = field_kind(field)
            if kind is None:
                other_labels += field in OTHER_LABEL_FIELDS
                continue
            g = last = groups.setdefault(key, {"image": {}, "label": {}, "first": m.name})
            g[kind].setdefault(qual, []).append(m)
            if kind == "label":
                labeled = True
        for g in groups.values():
            for m, label in _samples(walk, path, raw, g, walk.cut and g is last):
                members.append(m.name)
                offsets.append(m.offset)
                sizes.append(m.size)
                labels.append(label)
    return {"members": members, "offsets": offsets, "sizes": sizes, "labels": labels,
            "labeled": labeled, "other": other_labels, "rejected": walk.rejected}


def _members(walk: _Walk, path: str, raw, local: str):
    """The regular-file members of one shard (named ``path``, read from ``local``), in order;
    what the shard's end or a bad header cuts off is recorded as a ``"truncated shard"`` /
    ``"corrupt shard"`` entry."""
    if not os.path.isfile(local):
        raise SourceError(f"tar source: {path} is not a file")
    size = os.fstat(raw.fileno()).st_size
    magic = raw.read(6)
    if size == 0:
        walk.reject(path, "truncated shard", "zero-byte shard")
        return
    if magic.startswith(COMPRESSED_MAGIC):
        raise SourceError(f"tar source: {path} is compressed; random access needs plain, "
                          "uncompressed .tar shards")
    try:
        tf = tarfile.open(local, mode="r:")
    except tarfile.ReadError as e:
        if size < tarfile.BLOCKSIZE:
            walk.reject(path, "truncated shard", f"{size} bytes: cut inside the first header")
            return
        raise SourceError(f"tar source: {path} is not an uncompressed tar ({e}); "
                          "random access needs plain .tar shards") from e
    with tf:
        error = None
        try:
            for m in tf:
                if m.issym() or m.islnk():
                    walk.reject(f"{path}:{m.name}", "link member, not followed")
                    continue
                if m.isfile():
                    yield Member(m.name, m.offset_data, m.size, m.offset_data + m.size > size)
                elif not m.isdir() and split_member(m.name)[0] is not None:
                    walk.reject(f"{path}:{m.name}", "not a regular file")   # a FIFO or device entry
        except tarfile.ReadError as e:   # the shard ends inside a member's data
            error = str(e)
        end = tf.offset
    if error is not None:
        walk.cut = True
        walk.reject(path, "truncated shard", f"{error}: the shard ends at byte {size}, inside a member's "
                    "data; members after it are lost")
        return
    raw.seek(end)
    block = raw.read(tarfile.BLOCKSIZE)
    if not block:
        walk.cut = True
        walk.reject(path, "truncated shard", f"no end-of-archive marker after byte {end}: the shard "
                    "was cut at a block boundary; members after it are lost")
    elif len(block) < tarfile.BLOCKSIZE:
        walk.cut = True
        walk.reject(path, "truncated shard", f"cut inside a header at byte {end} (shard size {size}); "
                    "members after it are lost")
    elif block.count(0) != tarfile.BLOCKSIZE:
        walk.cut = True
        walk.reject(path, "corrupt shard", f"unreadable header at byte {end}; members after it are not "
                    "indexed")
    else:
        while True:   # the end marker and padding: zeros to the end, unless an archive was appended
            chunk = raw.read(1 << 20)
            if not chunk:
                break
            if chunk.count(0) != len(chunk):
                walk.reject(path, "corrupt shard", f"data after the end-of-archive marker at byte {end} (an "
                            "archive appended to this one?); members there are not indexed")
                break


def _samples(walk: _Walk, path: str, raw, g: dict, cut: bool = False):
    """``(image member, label)`` of one key group (label -2: none); the rest is rejected.
    ``cut``: the group is the last before a shard's damage, so an image without a label may
    have lost it there (rejected as ``"truncated"``, never delivered unlabeled)."""
    images, labels = g["image"], g["label"]
    used: set[str] = set()
    if not images:
        walk.reject(f"{path}:{g['first']}", "no image", "no image member has this key")
        return
    for qual, found in images.items():
        if qual and "" in images and qual not in labels:
            for m in found:
                walk.reject(f"{path}:{m.name}", "extra image in sample",
                            f"a second image field of the sample {images[''][0].name!r}")
            continue
        lab_q = qual if qual in labels else ""
        labs = labels.get(lab_q, [])
        used.add(lab_q)
        if len(found) > 1 or len(labs) > 1:
            names = [m.name for m in found] + [m.name for m in labs]
            for m in found:
                walk.reject(f"{path}:{m.name}", "duplicate key",
                            f"{len(found)} image(s) and {len(labs)} label(s) share it: {names}")
            continue
        m = found[0]
        if m.cut or (labs and labs[0].cut):
            walk.reject(f"{path}:{m.name}", "truncated", "the shard ends inside "
                        + ("its data" if m.cut else f"its label {labs[0].name!r}"))
            continue
        if m.size == 0:
            walk.reject(f"{path}:{m.name}", "empty")
            continue
        if cut and not labs:
            walk.reject(f"{path}:{m.name}", "truncated", "the last sample before the shard's damage, "
                        "without a label: its label member may be lost there")
            continue
        label = -2
        if labs:
            label = read_label(raw, labs[0])
            if label is None:
                walk.reject(f"{path}:{m.name}", "bad label",
                            f"{labs[0].name!r} does not hold a non-negative integer below 2**63")
                continue
        yield m, label
    for qual, labs in labels.items():
        if qual not in used and qual not in images:
            for m in labs:
                walk.reject(f"{path}:{m.name}", "no image", "a label without its image")
