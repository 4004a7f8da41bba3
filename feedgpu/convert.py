"""Convert datasets: an ImageFolder directory or tar shards to Parquet files (image bytes as
they are + label + metadata), and a folder to WebDataset tar shards."""
from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from .sources.base import CLASS_NAMES_FILE, Source
from .sources.folder import FolderSource
from .sources.tar import TarShardSource

PARQUET_SCHEMA = pa.schema([("key", pa.string()), ("image", pa.large_binary()), ("label", pa.int64()),
                            ("format", pa.string()), ("width", pa.int32()), ("height", pa.int32())])


def _stem(rel: str) -> str:
    return os.path.splitext(rel)[0].replace(os.sep, "/")


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


def write_class_names(out: Path, classes: list[str]) -> None:
    """:data:`~feedgpu.sources.base.CLASS_NAMES_FILE` in ``out``: the class names in label order, one per line, which the tar and
    Parquet sources read back (:func:`feedgpu.sources.base.class_names`). A folder name that is not
    UTF-8 (Python decodes it with surrogate escapes) is written as its own bytes, as the tar member
    names are."""
    if classes:
        (out / CLASS_NAMES_FILE).write_text("".join(f"{c}\n" for c in classes), encoding="utf-8",
                                            errors="surrogateescape")


def folder_to_tar(folder, out_dir, samples_per_shard: int = 1000, progress: bool = False) -> list[Path]:
    """Write ``shard-000000.tar`` ... with ``<class>/<name>.<ext>`` + ``<class>/<name>.cls``, and
    the class names in ``_classes.txt``."""
    src = FolderSource(folder)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_class_names(out, src.classes)
    shards: list[Path] = []
    tf = None
    with _progress(len(src), "tar shards", progress) as bar:
        for i in range(len(src)):
            if i % samples_per_shard == 0:
                if tf is not None:
                    tf.close()
                shards.append(out / f"shard-{len(shards):06d}.tar")
                tf = tarfile.open(shards[-1], "w", format=tarfile.USTAR_FORMAT)
            rec = src.read(i)
            rel = src.paths[i]
            ext = os.path.splitext(rel)[1].lstrip(".").lower() or "jpg"
            for name, data in ((f"{_stem(rel)}.{ext}", rec.payload), (f"{_stem(rel)}.cls", str(rec.label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            bar.update(1)
    if tf is not None:
        tf.close()
    return shards


def source_to_parquet(src: Source, out_dir, keys, rows_per_file: int = 1000, row_group_bytes: int = 8 << 20,
                      progress: bool = False) -> list[Path]:
    """Write ``part-000000.parquet`` ... with columns key, image (large_binary), label, format,
    width, height (from the header; -1 when unreadable); row groups of about ``row_group_bytes``
    of image data, uncompressed (JPEG bytes do not compress); the class names in ``_classes.txt``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_class_names(out, list(getattr(src, "classes", [])))
    files: list[Path] = []
    with _progress(len(src), "parquet", progress) as bar:
        for start in range(0, len(src), rows_per_file):
            stop = min(len(src), start + rows_per_file)
            recs = [src.read(i) for i in range(start, stop)]
            heads = [_header(r.payload) for r in recs]
            table = pa.table({"key": [keys(i) for i in range(start, stop)],
                              "image": pa.array([bytes(r.payload) for r in recs], pa.large_binary()),
                              "label": pa.array([r.label for r in recs], pa.int64()),
                              "format": [h[0] for h in heads],
                              "width": pa.array([h[1] for h in heads], pa.int32()),
                              "height": pa.array([h[2] for h in heads], pa.int32())}, schema=PARQUET_SCHEMA)
            mean = max(1, sum(len(r.payload) for r in recs) // len(recs))
            path = out / f"part-{len(files):06d}.parquet"
            pq.write_table(table, path, row_group_size=max(1, row_group_bytes // mean), compression="none")
            files.append(path)
            bar.update(stop - start)
    return files


def folder_to_parquet(folder, out_dir, rows_per_file: int = 1000, row_group_bytes: int = 8 << 20,
                      progress: bool = False) -> list[Path]:
    src = FolderSource(folder)
    return source_to_parquet(src, out_dir, lambda i: _stem(src.paths[i]), rows_per_file, row_group_bytes, progress)


def shards_to_parquet(shards, out_dir, rows_per_file: int = 1000, row_group_bytes: int = 8 << 20,
                      progress: bool = False) -> list[Path]:
    src = TarShardSource(shards)
    return source_to_parquet(src, out_dir, lambda i: _stem(src.members[i]), rows_per_file, row_group_bytes, progress)
