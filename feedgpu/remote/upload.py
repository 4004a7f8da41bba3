"""Uploads of a converted dataset to a folder URL (``feedgpu convert SRC s3://bucket/train``).

The dataset is built and read back locally first (atomically, as :mod:`feedgpu.convert` does),
then its files go up with fsspec's ``put_file``: the shards or Parquet files first, then
``_classes.txt``, then the index file ``_index.json``, so a reader that finds the index finds
every file it names. Each file is tried ``attempts`` times.
"""
from __future__ import annotations

import os
import time

from ..errors import UploadError
from .index import INDEX_FILE
from .urls import filesystem, join


def upload_dir(local_dir, url: str, storage_options: dict | None = None, attempts: int = 3,
               sleep=None) -> list[str]:
    """Upload the files of ``local_dir`` (not its subfolders) under the folder ``url``; returns
    the URLs written. Raises :class:`~feedgpu.errors.UploadError` naming the files that failed
    (the index file is not uploaded then)."""
    sleep = sleep or time.sleep
    fs, base = filesystem(url, storage_options)
    names = sorted(n for n in os.listdir(local_dir) if os.path.isfile(os.path.join(local_dir, n)))
    last = [INDEX_FILE] if INDEX_FILE in names else []
    order = [n for n in names if n not in last and not n.startswith("_")] + \
            [n for n in names if n.startswith("_") and n not in last] + last
    try:
        fs.makedirs(base, exist_ok=True)
    except Exception:  # noqa: BLE001 - stores without folders (or an existing bucket) need none
        pass
    uploaded: list[str] = []
    failed: list[tuple[str, str]] = []
    for name in order:
        target = join(url, name)
        if name in last and failed:
            failed.append((target, "not uploaded: other files failed"))
            continue
        for k in range(attempts):
            try:
                fs.put_file(os.path.join(local_dir, name), join(base, name))
                uploaded.append(target)
                break
            except Exception as e:  # noqa: BLE001 - the store's errors, retried then reported
                if k + 1 == attempts:
                    failed.append((target, f"{type(e).__name__}: {e}"))
                else:
                    sleep(0.5 * 2 ** k)
    if failed:
        raise UploadError(f"upload to {url}: {len(failed)} of {len(order)} file(s) failed ("
                          + "; ".join(f"{u}: {why}" for u, why in failed[:5])
                          + f"); {len(uploaded)} uploaded. The dataset at {url} is incomplete: "
                          "run the conversion again", uploaded, failed)
    return uploaded
