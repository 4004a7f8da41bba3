"""A vectorised index of plain tar shards: the common WebDataset layout without :mod:`tarfile`.

:func:`scan_plain` reads a shard into memory once and finds its ustar headers with numpy instead
of one Python object per member. It answers only for shards it can index *exactly* as
:class:`~feedgpu.sources.tar.TarShardSource` indexes them through :mod:`tarfile`, and returns None
for any other shard (the caller then indexes it with :mod:`tarfile`, rejects and all). A shard is
plain when:

* its headers are POSIX ustar (``ustar\\0`` magic) with a valid checksum, octal numeric fields and
  no name prefix, each a regular file (type ``0`` or NUL) with an ASCII name not ending in ``/``;
  no pax, GNU long-name, link, directory or device members;
* the members chain from byte 0, each header right after the previous member's data (so no
  header-like block inside a member's data is taken for a header), the data of each within the
  shard, and only zero bytes (at least one block) after the last member;
* every member is ``<key>.<ext>`` with an unqualified image extension or label field (``jpg``,
  ``cls``, ...: :data:`~feedgpu.sources.tar.members.IMAGE_SUFFIXES`, ``LABEL_SUFFIXES``, any case) and
  each key has exactly one image and one label, the image non-empty and the label 1 to 18 ASCII
  digits (no blanks).

Such a shard has no rejected record, so the result is the same arrays the :mod:`tarfile` path
gives: members in the order of their key's first member, data offsets and sizes, labels.
"""
from __future__ import annotations

import mmap
import os

import numpy as np

_BLOCK = 512
_NAME = 100
_MAX_LABEL_DIGITS = 18   # below 2**63 whatever the digits
#: Numeric header fields :mod:`tarfile` parses (offset, width): mode, uid, gid, size, mtime,
#: checksum, devmajor, devminor; any that it could not parse makes a header invalid there.
_NUMERIC = ((100, 8), (108, 8), (116, 8), (124, 12), (136, 12), (148, 8), (329, 8), (337, 8))


def _octal_fields(f: np.ndarray, constant: bool | None = None) -> np.ndarray | None:
    """One numeric field per header (``f``: its bytes, one row a header) as :mod:`tarfile` reads
    it (``tarfile.nti``), or None when one cannot be read or is base-256. The usual forms
    (``width - 1`` or ``width - 2`` octal digits, then NULs or blanks) are read with numpy, any
    other through ``nti`` itself, once per distinct value. ``constant``: whether every row is
    the same (found here when None)."""
    width = f.shape[1]
    if constant is None:
        constant = bool((f == f[0]).all())
    if constant:                                          # one value in every header (mode, uid, mtime...)
        import tarfile

        b = f[0].tobytes()
        try:
            return None if b[0] in (0o200, 0o377) else np.full(len(f), tarfile.nti(b), np.int64)
        except (ValueError, UnicodeError, tarfile.TarError):
            return None
    d = f - np.uint8(48)                                  # an octal digit is 0-7, anything else wraps above
    for k in (width - 1, width - 2):                      # every header in one form (what one writer gives)
        tail = f[:, k:]
        if (d[:, :k] <= 7).all() and ((tail == 0) | (tail == 32)).all():
            return _digits(d[:, :k])
    octal = d <= 7
    pad = (f == 0) | (f == 32)
    value = np.zeros(len(f), np.int64)
    done = np.zeros(len(f), bool)
    for k in (width - 1, width - 2):
        if done.all():
            break
        form = octal[:, :k].all(axis=1) & pad[:, k:].all(axis=1) & ~done
        if form.any():
            value = np.where(form, _digits(d[:, :k]), value)
            done |= form
    if not done.all():
        import tarfile

        odd = np.flatnonzero(~done)
        uniq, inverse = np.unique(f[odd], axis=0, return_inverse=True)
        parsed = []
        for u in uniq:
            b = u.tobytes()
            if b[0] in (0o200, 0o377):
                return None
            try:
                parsed.append(tarfile.nti(b))
            except (ValueError, UnicodeError, tarfile.TarError):
                return None
        value[odd] = np.asarray(parsed, dtype=np.int64)[inverse.ravel()]
    return value


def _varying_bytes(rows: np.ndarray) -> np.ndarray:
    """Which of the 512 byte columns of ``rows`` (one header a row) differ from the first row in
    any row, as 512 booleans: first the 64-bit words that differ anywhere, then, for those only,
    which of their bytes (each word XOR the first header's, OR-ed over the headers)."""
    w = rows.view("<u8")
    idx = np.flatnonzero((w != w[0]).any(axis=0))
    diff = np.zeros(64, np.uint64)
    if idx.size:
        sub = w[:, idx]
        diff[idx] = np.bitwise_or.reduce(sub ^ sub[0], axis=0)
    return diff.view(np.uint8) != 0


def _byte_sums(words: np.ndarray) -> np.ndarray:
    """The sum of the bytes of each row of ``words`` (uint64, at most 64 a row) as int64: the
    bytes of each word added in four 16-bit lanes (at most 2 * 255 a word, 32,640 a row), the
    lanes added at the end."""
    lanes = np.uint64(0x00FF00FF00FF00FF)
    s = ((words & lanes) + ((words >> np.uint64(8)) & lanes)).sum(axis=1, dtype=np.uint64)
    m = np.uint64(0xFFFF)
    return ((s & m) + ((s >> np.uint64(16)) & m) + ((s >> np.uint64(32)) & m) + (s >> np.uint64(48))).astype(np.int64)


def _digits(d: np.ndarray) -> np.ndarray:
    """Octal digits (values 0-7, one row a number, most significant first) as int64: the digits
    times their powers of 8 in one product, exact in float64 for up to 17 digits."""
    k = d.shape[1]
    return (d.astype(np.float64) @ (8.0 ** np.arange(k - 1, -1, -1))).astype(np.int64)


def scan_plain(path: str, image_fields, label_fields) -> dict | None:
    """The index of a plain shard (module docstring), or None when it is not plain.

    Returns ``{"blob": uint8 names of the images, "lens": name lengths, "offsets": data offsets,
    "sizes": sizes (each in the smallest unsigned dtype that holds it, :func:`narrow`), "labels": int64}``, one row per sample in the order the
    :mod:`tarfile` path gives."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 2 * _BLOCK or size % _BLOCK:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            data = np.frombuffer(mm, dtype=np.uint8)
            try:
                return _scan(data, size, image_fields, label_fields)
            finally:
                del data


def _scan(data: np.ndarray, size: int, image_fields, label_fields) -> dict | None:
    blocks = data.reshape(-1, _BLOCK)
    magic = np.ascontiguousarray(blocks[:, 256:264]).view("<u8").ravel()   # one pass over the shard
    want = np.frombuffer(b"\0ustar\0\0", "<u8")[0]
    mask = np.frombuffer(b"\0\xff\xff\xff\xff\xff\xff\0", "<u8")[0]   # bytes 257-262
    cand = np.flatnonzero((magic & mask) == want)
    if cand.size == 0 or cand[0] != 0:
        return None
    rows = np.take(blocks, cand, axis=0)                  # a copy: the headers only
    vary = _varying_bytes(rows)                           # a column the same in every header is checked once
    if not np.all((rows[:, 156] == ord("0")) | (rows[:, 156] == 0)):
        return None
    if rows[0, 345:500].any() or vary[345:500].any():    # a ustar name prefix in some header
        return None
    values = {}
    for start, width in _NUMERIC:
        value = _octal_fields(rows[:, start:start + width], not vary[start:start + width].any())
        if value is None:
            return None
        values[start] = value
    # the checksum: the header's bytes with its own field as 8 blanks; the words that are the same
    # in every header add the same to each
    moving = vary.reshape(64, 8).any(axis=1)
    moving[18:20] = True                                  # words 18-19 (bytes 144-159) hold the checksum field
    idx = np.flatnonzero(moving)
    words = rows.view("<u8")[:, idx]                      # a copy: the checksum bytes are cleared in it
    k = int(np.searchsorted(idx, 18))
    words[:, k] &= np.uint64(0x00000000FFFFFFFF)          # less bytes 148-151
    words[:, k + 1] &= np.uint64(0xFFFFFFFF00000000)      # less bytes 152-155
    summed = int(rows[0].reshape(64, 8)[~moving].sum()) + _byte_sums(words) + 8 * 32
    if not np.array_equal(summed, values[148]):
        return None
    sizes = values[124]
    nxt = cand + 1 + (sizes + _BLOCK - 1) // _BLOCK
    if not np.array_equal(nxt[:-1], cand[1:]):
        return None
    end = int(nxt[-1]) * _BLOCK
    if end + _BLOCK > size or np.any(data[end:]):
        return None
    used = np.flatnonzero(vary[:_NAME] | (rows[0, :_NAME] != 0))
    bound = int(used[-1]) + 1 if used.size else 0        # the columns from here on are NUL in every name
    if bound == 0:
        return None
    raw = np.ascontiguousarray(rows[:, :bound])
    if np.any(raw >= 128):                                # a name that is not ASCII
        return None
    names = raw.view(f"S{bound}").ravel()                 # numpy's bytes strings: trailing NULs dropped
    lens = np.strings.str_len(names)
    # tarfile ends a name at its first NUL, numpy's string at its last byte that is not NUL: the
    # same when no NUL lies inside a name, i.e. when the names' non-NUL bytes number their lengths
    if np.count_nonzero(raw) != int(lens.sum()) or np.any(lens == 0) or np.strings.endswith(names, b"/").any():
        return None
    n = len(cand)
    slash = np.strings.rfind(names, b"/")                 # -1 when none
    dot = np.strings.find(names, b".", slash + 1)         # the first dot of the base name
    if np.any(dot < 0) or np.any(dot == slash + 1):       # no field, or a base name starting with a dot
        return None
    width = 8
    field_len = lens - dot - 1
    if np.any(field_len > width) or np.any(field_len < 1):
        return None
    field = np.strings.slice(names, dot + 1, lens).astype(f"S{width}")
    field = np.ascontiguousarray(field).view(np.uint8).reshape(n, width).copy()
    upper = (field >= ord("A")) & (field <= ord("Z"))
    field[upper] += 32
    field = field.view("<u8").ravel()                    # the lower-cased field, NUL-padded, as one integer
    is_image = np.isin(field, _codes(image_fields))
    is_label = np.isin(field, _codes(label_fields))
    if not np.all(is_image | is_label):
        return None
    keys = np.strings.slice(names, 0, dot)
    order = np.argsort(keys, kind="stable")
    if n % 2:
        return None
    a, b = order[0::2], order[1::2]
    if not np.array_equal(keys[a], keys[b]) or np.any(keys[order[2::2]] == keys[order[1:-1:2]]):
        return None
    img = np.where(is_image[a], a, b)
    lab = np.where(is_image[a], b, a)
    if not np.all(is_image[img] & is_label[lab]):
        return None
    first = np.minimum(a, b)
    g = np.argsort(first, kind="stable")
    img, lab = img[g], lab[g]
    if np.any(sizes[img] == 0):
        return None
    lab_size = sizes[lab]
    if np.any(lab_size < 1) or np.any(lab_size > _MAX_LABEL_DIGITS):
        return None
    lab_at = (cand[lab] + 1) * _BLOCK
    longest = int(lab_size.max())
    digits = data[np.minimum(lab_at[:, None] + np.arange(longest), size - 1)]
    used = np.arange(longest) < lab_size[:, None]
    if not np.all(~used | ((digits >= 48) & (digits <= 57))):
        return None
    labels = np.zeros(len(lab), np.int64)
    for j in range(longest):                              # Horner over the digit columns
        labels = np.where(used[:, j], labels * 10 + (digits[:, j].astype(np.int64) - 48), labels)
    blob = raw[img][np.arange(bound) < lens[img][:, None]]
    return {"blob": np.ascontiguousarray(blob, dtype=np.uint8), "lens": narrow(lens[img]),
            "offsets": narrow((cand[img] + 1) * _BLOCK), "sizes": narrow(sizes[img]), "labels": labels}


def _codes(fields) -> np.ndarray:
    """Field names of up to 8 bytes as the little-endian integers of their NUL-padded bytes."""
    return np.array([int.from_bytes(f.encode().ljust(8, b"\0"), "little") for f in fields if len(f.encode()) <= 8],
                    dtype=np.uint64)


def narrow(a: np.ndarray) -> np.ndarray:
    """Non-negative integers in the smallest unsigned dtype that holds them (uint8 to uint64)."""
    top = int(a.max()) if a.size else 0
    for dt in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dt).max:
            return a.astype(dt)
    return a.astype(np.uint64)
