"""Convert datasets: an ImageFolder directory or tar shards to Parquet files (image bytes as
they are + label + metadata), and a folder to WebDataset tar shards.

Every converter holds the conservation rule: each record of the source is in the output, with
its label, or in the returned :class:`Converted` report's ``left_out`` (what the source left out
while indexing, with the reason). Output is written to a temporary folder beside ``out_dir``,
read back (sample count, labels and, for tar, sizes checked against the source), and renamed to
``out_dir`` only then: a failed conversion leaves nothing behind. The temporary folder is
``.<out_dir name>.partial-<pid>``; one a killed convert left (its process gone) is removed by the
next convert into the same ``out_dir`` (:func:`remove_stale_partials`). ``out_dir`` must not exist or
be empty. Every image ending the folder source reads
(:data:`~feedgpu.sources.extensions.IMAGE_EXTENSIONS`) is an image member the tar source reads. Beside the files: ``_classes.txt`` (class names) and ``_index.json`` (the files with
their sizes and SHA-256, and for tar the member table: :mod:`feedgpu.remote.index`), which
names the dataset by one path or URL where the store cannot list (HTTP). Beside each tar shard:
its member table (``<shard>.feedgpu-index``, :mod:`feedgpu.sources.tar.table`), so a tar source
opening the shards on another machine or with a new cache dir does not index them.

Sample keys (:func:`sample_keys`): a file's path relative to the dataset, without its
extension, with ``%`` and ``.`` in its base name written ``%25`` and ``%2E``, so a key never holds
a dot and WebDataset's first-dot rule reads it back whole (``img.v2.0001.jpg`` -> key
``img%2Ev2%2E0001``). Files whose keys would collide (``x.jpg`` and ``x.png``) keep their
extension in the key (``x%2Ejpg``, ``x%2Epng``); a key still taken gets ``%23<n>`` (``#n``). In
Parquet's ``key`` column (UTF-8 text) the bytes of a name that are not UTF-8 are written
``%XX``; tar member names keep their bytes (PAX headers, which also hold names too long for a
plain tar header).
"""
from __future__ import annotations

import io
import os
import re
import shutil
import tarfile
import tempfile
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from .errors import ConfigError, SourceError
from .remote.folder import alive
from .remote.index import write_index
from .sources.base import CLASS_NAMES_FILE, Source, encode_class_name
from .sources.class_names import ClassNames
from .sources.folder import FolderSource
from .sources.tar import TarShardSource
from .sources.tar.local import write_tables

PARQUET_SCHEMA = pa.schema([("key", pa.string()), ("image", pa.large_binary()), ("label", pa.int64()),
                            ("format", pa.string()), ("width", pa.int32()), ("height", pa.int32())])


class Converted(list):
    """The files written (a list of :class:`~pathlib.Path`), with ``samples``: samples written
    and read back; ``left_out``: ``[(key, reason)]`` of the source's records not in the output
    (left out by the source while indexing)."""

    def __init__(self, files, samples: int, left_out):
        super().__init__(files)
        self.samples = int(samples)
        self.left_out = list(left_out)


def _escape(stem: str) -> str:
    return stem.replace("%", "%25").replace(".", "%2E")


def sample_keys(names: list[str]) -> list[str]:
    """Unique, dot-free keys for relative file names (rule in the module docstring)."""
    split = []
    for name in names:
        name = name.replace(os.sep, "/")
        head, slash, base = name.rpartition("/")
        stem, ext = os.path.splitext(base)
        split.append((head + slash, stem, ext))
    keys = [h + _escape(s) for h, s, _ in split]
    seen: dict[str, int] = {}
    for k in keys:
        seen[k] = seen.get(k, 0) + 1
    keys = [h + _escape(s + e) if seen[k] > 1 else k for k, (h, s, e) in zip(keys, split)]
    taken: set[str] = set()
    out = []
    for k in keys:
        u, n = k, 1
        while u in taken:
            u, n = f"{k}%23{n}", n + 1
        taken.add(u)
        out.append(u)
    return out


_SURROGATE = re.compile("[\udc80-\udcff]")


def text_key(key: str) -> str:
    """``key`` as valid UTF-8 text: bytes that were not UTF-8 (surrogate escapes) as ``%XX``."""
    return _SURROGATE.sub(lambda m: f"%{ord(m.group()) - 0xDC00:02X}", key)


def _progress(total: int, desc: str, on: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img", disable=not on)


def _header(data) -> tuple[str | None, int, int]:
    """Format and size from the image header (nothing decoded); (None, -1, -1) if unreadable."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.format, im.width, im.height
    except Exception:  # noqa: BLE001 - bad samples are converted as they are and skipped when read
        return None, -1, -1


def write_class_names(out: Path, classes) -> None:
    """:data:`~feedgpu.sources.base.CLASS_NAMES_FILE` in ``out``: the class names in label order, one per line, which the tar and
    Parquet sources read back (:func:`feedgpu.sources.base.class_names`). A folder name that is not
    UTF-8 (Python decodes it with surrogate escapes) is written as its own bytes, as the tar member
    names are; ``%``, newline and carriage return as ``%25``, ``%0A``, ``%0D``
    (:func:`~feedgpu.sources.base.encode_class_name`), so a name never spans two lines. Integer
    labels without names (a :class:`~feedgpu.sources.class_names.ClassNames` not read from a names
    file) write no file: the sources read them back as the same names."""
    if isinstance(classes, ClassNames) and not classes.named:
        return
    if len(classes):
        (out / CLASS_NAMES_FILE).write_text("".join(f"{encode_class_name(c)}\n" for c in classes),
                                            encoding="utf-8", errors="surrogateescape", newline="")


#: Prefix of the local folder a convert to a URL builds in (in the system's temporary folder),
#: followed by the convert's process id and ``-``.
URL_BUILD_PREFIX = "feedgpu-convert-"


def remove_stale_partials(out) -> list[Path]:
    """Remove the temporary folders (``.<out name>.partial-<pid>`` beside ``out``) that converts
    into ``out`` killed before they finished left, those whose process is gone from this machine
    (a live one's is another convert at work); one warning names them. Returns them."""
    out = Path(out)
    return _remove_dead(out.parent, re.compile(re.escape(f".{out.name}.partial-") + r"(\d+)"), f"into {out}")


def remove_stale_url_builds() -> list[Path]:
    """The same for the folders converts to a URL build in (``<tmp>/feedgpu-convert-<pid>-*``)."""
    return _remove_dead(Path(tempfile.gettempdir()), re.compile(re.escape(URL_BUILD_PREFIX) + r"(\d+)-.*"),
                        "to a URL")


def _remove_dead(folder: Path, pattern: re.Pattern, what: str) -> list[Path]:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    gone = []
    for name in names:
        m = pattern.fullmatch(name)
        pid = int(m.group(1)) if m else 0
        if pid and pid != os.getpid() and not alive(pid) and (folder / name).is_dir():
            shutil.rmtree(folder / name, ignore_errors=True)
            gone.append(folder / name)
    if gone:
        warnings.warn(f"feedgpu convert: removed the partial output of {len(gone)} earlier convert(s) {what} "
                      f"that did not finish (their processes are gone): {', '.join(map(str, gone))}", stacklevel=4)
    return gone


class _Staging:
    """A temporary folder beside ``out``, renamed to ``out`` by :meth:`commit`, removed otherwise."""

    def __init__(self, out):
        self.out = Path(out)
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ConfigError(f"convert: {self.out} exists and is not an empty folder; give a new one")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.dir = self.out.parent / f".{self.out.name}.partial-{os.getpid()}"
        remove_stale_partials(self.out)
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)

    def commit(self, files: list[Path]) -> list[Path]:
        if self.out.exists():
            self.out.rmdir()
        os.replace(self.dir, self.out)
        return [self.out / f.name for f in files]


def _open_quiet(cls, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(path)


def _verify(got: Source, src: Source, what: str, written: list[str] | None = None) -> None:
    """The output read back holds the source's samples, in order, with their labels; else
    :class:`SourceError` naming the source's files that did not come back (``written``: the name
    each sample was written under, compared with the output's ``members``) and what the output
    left out while it was read back."""
    if len(got) != len(src):
        lost = []
        if written is not None and hasattr(got, "members"):
            back = {got.members[i] for i in range(len(got))}
            lost = [f"{src.key(i)} (written as {name})" for i, name in enumerate(written) if name not in back]
        msg = f"convert: {what} read back as {len(got)} samples, the source has {len(src)}"
        if lost:
            msg += f"; not read back ({len(lost)}): " + ", ".join(lost[:10]) + (" ..." if len(lost) > 10 else "")
        if got.rejected:
            msg += (f"; left out reading them back ({len(got.rejected)}): "
                    + ", ".join(f"{k}: {r}" for k, r in got.rejected[:10]) + (" ..." if len(got.rejected) > 10 else ""))
        raise SourceError(msg + "; nothing was written")
    if not (got.labels == src.labels).all():
        i = int((got.labels != src.labels).argmax())
        raise SourceError(f"convert: {what} read back with label {int(got.labels[i])} for {src.key(i)}, "
                          f"the source has {int(src.labels[i])}; nothing was written")
    if got.rejected:
        raise SourceError(f"convert: {what} read back with {len(got.rejected)} record(s) left out "
                          f"(first: {got.rejected[0]}); nothing was written")


def folder_to_tar(folder, out_dir, samples_per_shard: int = 1000, progress: bool = False) -> Converted:
    """Write ``shard-000000.tar`` ... with ``<key>.<ext>`` + ``<key>.cls`` per image (keys:
    :func:`sample_keys`, e.g. ``<class>/<name>``), PAX format, the class names in
    ``_classes.txt`` and each shard's member table beside it (``<shard>.feedgpu-index``). Returns :class:`Converted`; raises :class:`ConfigError` when ``out_dir``
    is not new or empty, :class:`SourceError` when the output does not read back as the source."""
    src = FolderSource(folder)
    rels = [src.paths[i] for i in range(len(src))]
    keys = sample_keys(rels)
    with _Staging(out_dir) as stage:
        write_class_names(stage.dir, src.classes)
        shards: list[Path] = []
        written: list[str] = []   # each sample's image member
        tf = None
        try:
            with _progress(len(src), "tar shards", progress) as bar:
                for i in range(len(src)):
                    if i % samples_per_shard == 0:
                        if tf is not None:
                            tf.close()
                        shards.append(stage.dir / f"shard-{len(shards):06d}.tar")
                        tf = tarfile.open(shards[-1], "w", format=tarfile.PAX_FORMAT)
                    rec = src.read(i)
                    written.append(f"{keys[i]}.{os.path.splitext(rels[i])[1].lstrip('.').lower() or 'jpg'}")
                    for name, data in ((written[i], rec.payload), (f"{keys[i]}.cls", str(rec.label).encode())):
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        tf.addfile(info, io.BytesIO(data))
                    bar.update(1)
        finally:
            if tf is not None:
                tf.close()
        got = _open_quiet(TarShardSource, [str(s) for s in shards])
        _verify(got, src, "the tar shards", written)
        if not (got.sizes == src.sizes).all():
            raise SourceError("convert: the tar shards read back with other sizes than the source's files; "
                              "nothing was written")
        write_tables([str(s) for s in shards])
        write_index(stage.dir, shards, "tar", got)
        return Converted(stage.commit(shards), len(got), src.rejected)


def source_to_parquet(src: Source, out_dir, keys, rows_per_file: int = 1000, row_group_bytes: int = 8 << 20,
                      progress: bool = False) -> Converted:
    """Write ``part-000000.parquet`` ... with columns key (``keys[i]`` as text, see
    :func:`text_key`), image (large_binary), label, format, width, height (from the header; -1
    when unreadable); row groups of about ``row_group_bytes`` of image data, uncompressed (JPEG
    bytes do not compress), in pages of about 1 MiB (what a reader holds at least, see
    :mod:`feedgpu.sources.parquet`); the class names in ``_classes.txt``. Returns :class:`Converted`."""
    if callable(keys):
        keys = [keys(i) for i in range(len(src))]
    with _Staging(out_dir) as stage:
        write_class_names(stage.dir, getattr(src, "classes", []))
        files: list[Path] = []
        with _progress(len(src), "parquet", progress) as bar:
            for start in range(0, len(src), rows_per_file):
                stop = min(len(src), start + rows_per_file)
                recs = [src.read(i) for i in range(start, stop)]
                heads = [_header(r.payload) for r in recs]
                table = pa.table({"key": [text_key(keys[i]) for i in range(start, stop)],
                                  "image": pa.array([bytes(r.payload) for r in recs], pa.large_binary()),
                                  "label": pa.array([r.label for r in recs], pa.int64()),
                                  "format": [h[0] for h in heads],
                                  "width": pa.array([h[1] for h in heads], pa.int32()),
                                  "height": pa.array([h[2] for h in heads], pa.int32())}, schema=PARQUET_SCHEMA)
                mean = max(1, sum(len(r.payload) for r in recs) // len(recs))
                path = stage.dir / f"part-{len(files):06d}.parquet"
                # pages of ~1 MiB of images, no dictionary for them (image bytes never repeat): pyarrow
                # otherwise puts up to 1024 values in a page, the unit a reader must hold whole
                pq.write_table(table, path, row_group_size=max(1, row_group_bytes // mean), compression="none",
                               use_dictionary=["key", "format"], data_page_size=1 << 20,
                               write_batch_size=max(1, min(1024, (1 << 20) // mean)))
                files.append(path)
                bar.update(stop - start)
        from .sources.parquet import ParquetSource

        got = _open_quiet(ParquetSource, [str(f) for f in files])
        _verify(got, src, "the Parquet files")
        write_index(stage.dir, files, "parquet")
        return Converted(stage.commit(files), len(got), src.rejected)


def folder_to_parquet(folder, out_dir, rows_per_file: int = 1000, row_group_bytes: int = 8 << 20,
                      progress: bool = False) -> Converted:
    src = FolderSource(folder)
    keys = sample_keys([src.paths[i] for i in range(len(src))])
    return source_to_parquet(src, out_dir, keys, rows_per_file, row_group_bytes, progress)


def shards_to_parquet(shards, out_dir, rows_per_file: int = 1000, row_group_bytes: int = 8 << 20,
                      progress: bool = False) -> Converted:
    src = TarShardSource(shards)
    keys = sample_keys([src.members[i] for i in range(len(src))])
    return source_to_parquet(src, out_dir, keys, rows_per_file, row_group_bytes, progress)
