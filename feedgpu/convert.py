"""Convert an ImageFolder dataset to WebDataset tar shards or Parquet files (image bytes as is)."""
from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .sources.folder import FolderSource

PARQUET_SCHEMA = pa.schema([("key", pa.string()), ("image", pa.large_binary()), ("label", pa.int64())])


def _stem(rel: str) -> str:
    return os.path.splitext(rel)[0].replace(os.sep, "/")


def folder_to_tar(folder, out_dir, samples_per_shard: int = 1000) -> list[Path]:
    """Write ``shard-000000.tar`` ... with ``<class>/<name>.<ext>`` + ``<class>/<name>.cls``."""
    src = FolderSource(folder)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[Path] = []
    tf = None
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
    if tf is not None:
        tf.close()
    return shards


def folder_to_parquet(folder, out_dir, rows_per_file: int = 1000, row_group_bytes: int = 8 << 20) -> list[Path]:
    """Write ``part-000000.parquet`` ... with columns key, image (large_binary), label; row groups
    of about ``row_group_bytes`` of image data, uncompressed (JPEG bytes do not compress)."""
    src = FolderSource(folder)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    for start in range(0, len(src), rows_per_file):
        stop = min(len(src), start + rows_per_file)
        recs = [src.read(i) for i in range(start, stop)]
        table = pa.table({"key": [_stem(src.paths[i]) for i in range(start, stop)],
                          "image": pa.array([r.payload for r in recs], pa.large_binary()),
                          "label": pa.array([r.label for r in recs], pa.int64())}, schema=PARQUET_SCHEMA)
        mean = max(1, sum(len(r.payload) for r in recs) // len(recs))
        path = out / f"part-{len(files):06d}.parquet"
        pq.write_table(table, path, row_group_size=max(1, row_group_bytes // mean), compression="none")
        files.append(path)
    return files
