"""The index file of a converted dataset: ``_index.json`` beside its shards or Parquet files.

``feedgpu convert`` writes it, so a dataset on a store that cannot list (HTTP) can be named by
one URL, and so a tar source needs no shard to build its index (a new machine starts reading at
once). Layout (JSON, UTF-8)::

    {"format": "feedgpu.index/1",
     "kind": "tar" | "parquet",
     "files": [{"name": "shard-000000.tar",          # relative to the index file's folder
                "size": 1234567,                     # bytes
                "sha256": "…",                       # of the whole file: downloads are checked
                "samples": {"members": [...],        # tar only: the samples the tar source
                            "offsets": [...],        # indexed, in order: member name, byte
                            "sizes": [...],          # offset and size of its data, label
                            "labels": [...]}}]}

A file whose size is not the index's is refused when it is downloaded (it is not the file the
index describes).
"""
from __future__ import annotations

import hashlib
import json
import os

from ..errors import SourceError

FORMAT = "feedgpu.index/1"
INDEX_FILE = "_index.json"


def is_index(spec) -> bool:
    """True for one path or URL ending in ``.json`` (an index file)."""
    return isinstance(spec, (str, os.PathLike)) and os.fspath(spec).endswith(".json")


def sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_index(folder, files, kind: str, source=None) -> str:
    """Write ``folder/_index.json`` for ``files`` (local paths in ``folder``); for ``kind="tar"``
    the samples of ``source`` (a :class:`~feedgpu.sources.tar.TarShardSource` over exactly these
    files) go in too. Returns the index path. Written to a temporary name, then renamed."""
    entries = []
    for sid, f in enumerate(files):
        f = os.fspath(f)
        entry = {"name": os.path.basename(f), "size": os.path.getsize(f), "sha256": sha256_file(f)}
        if kind == "tar" and source is not None:
            rows = (source.shard_ids == sid).nonzero()[0]
            entry["samples"] = {"members": [source.members[int(i)] for i in rows],
                                "offsets": source.offsets[rows].tolist(),
                                "sizes": source.sizes[rows].tolist(),
                                "labels": source.labels[rows].tolist()}
        entries.append(entry)
    path = os.path.join(os.fspath(folder), INDEX_FILE)
    tmp = path + f".tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as fh:
        json.dump({"format": FORMAT, "kind": kind, "files": entries}, fh, ensure_ascii=False)
    os.replace(tmp, path)
    return path


def index_kind(url: str, storage_options: dict | None = None) -> str:
    """``"tar"`` or ``"parquet"``: what the index file at ``url`` (or local path) describes.
    Raises :class:`SourceError` when it cannot be read or is not a feedgpu index."""
    from .urls import filesystem, is_url

    where = url if is_url(url) else "file://" + os.path.abspath(url)
    fs, path = filesystem(where, storage_options)
    try:
        doc = json.loads(fs.cat_file(path).decode("utf-8", "surrogateescape"))
    except (OSError, ValueError) as e:
        raise SourceError(f"{url}: cannot read the index file ({type(e).__name__}: {e})") from None
    kind = doc.get("kind") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    if kind not in ("tar", "parquet"):
        raise SourceError(f"{url}: not a feedgpu index file of tar or parquet files")
    return kind


def parse_index(text: str, where: str, kind: str) -> list[dict]:
    """The ``files`` entries of an index file's text; raises :class:`SourceError` when it is not
    a feedgpu index or describes another kind of data."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SourceError(f"{where}: not a feedgpu index file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), list):
        raise SourceError(f"{where}: not a feedgpu index file (expected \"format\": \"{FORMAT}\" and a "
                          "\"files\" list)")
    if doc.get("kind") != kind:
        raise SourceError(f"{where}: an index of {doc.get('kind')!r} files, read as a {kind} source")
    for e in doc["files"]:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("size"), int):
            raise SourceError(f"{where}: a file entry without name and size: {e!r}"[:300])
    return doc["files"]
