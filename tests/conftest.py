"""Shared fixtures: small real datasets built once per session from ``../shared``.

``shared/`` sits beside the repository (CI clones the repository with ``shared/`` next to it), so
it is found relative to this file, never through an environment variable.
"""
from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from feedgpu.convert import folder_to_parquet, folder_to_tar
from feedgpu.sample_data import build_imagenet_like

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PHOTOS = SHARED / "data" / "photos"
CASES = SHARED / "cases" / "images"

#: Images in the main sample dataset (ImageNet-like recipe, 400-640 px, one class per photo).
N_IMAGES = 120


def pytest_configure(config):
    if not PHOTOS.is_dir() or not CASES.is_dir():
        raise pytest.UsageError(f"tests need the shared data beside the repository: {PHOTOS} and {CASES}")


#: The tiers (folders of ``tests/``), each also a marker (``pytest tests -m engines``).
TIERS = ("unit", "integration", "engines", "gpu", "tv")


def pytest_collection_modifyitems(config, items):
    """Mark each test with the tier its folder names; a test outside the tier folders is an error
    (it would run in no tier's selection)."""
    stray = []
    for item in items:
        tier = Path(str(item.fspath)).resolve().relative_to(REPO / "tests").parts[0]
        if tier not in TIERS:
            stray.append(item.nodeid)
            continue
        item.add_marker(getattr(pytest.mark, tier))
    if stray:
        raise pytest.UsageError("tests outside the tier folders (tests/unit, integration, engines, gpu, tv): "
                                + ", ".join(stray[:5]))


def _torchvision_missing() -> str | None:
    """Why torchvision does not import here (None when it does). ``.venv`` holds torch's CPU
    build, beside which PyPI's torchvision fails to load its ops: tests/tv runs in ``.venv-tv``
    (scripts/setup_tv.sh; scripts/test.sh and .ci/run run it there)."""
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or the RuntimeError of ops built for another torch
        return f"{type(e).__name__}: {e}"
    return None


def pytest_ignore_collect(collection_path, config):
    """Where torchvision does not import, tests/tv holds one test, test_tv_environment.py, which
    skips saying why; its other files are not collected (they import torchvision)."""
    p = Path(collection_path)
    if p.suffix == ".py" and p.parent.name == "tv" and p.parent.parent == REPO / "tests" \
            and p.name.startswith("test_") and p.name != "test_tv_environment.py":
        return _torchvision_missing() is not None or None
    return None


@pytest.fixture(scope="session")
def small_ds(folder_ds, tmp_path_factory) -> Path:
    """The sample dataset's images with the short side reduced to 160-200 px (ImageFolder
    layout, JPEG quality 90): cheap samples for statistics over thousands of them (tests/tv)."""
    from PIL import Image

    out = tmp_path_factory.mktemp("small") / "train"
    for k, src in enumerate(sorted(Path(folder_ds).rglob("*.jpg"))):
        dst = out / src.parent.name / src.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(src) as im:
            im = im.convert("RGB")
            short = 160 + (k * 7) % 41
            scale = short / min(im.size)
            im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))),
                      Image.Resampling.BILINEAR).save(dst, quality=90)
    return out


def case_files() -> list[str]:
    """Every file in ``shared/cases/images`` (new files are picked up automatically)."""
    return sorted(p.name for p in CASES.iterdir() if p.is_file())


# -- the main sample dataset in three formats ------------------------------------------------------
@pytest.fixture(scope="session")
def folder_ds(tmp_path_factory) -> Path:
    return build_imagenet_like(tmp_path_factory.mktemp("folder") / "train", N_IMAGES, photos_dir=PHOTOS, seed=0)


@pytest.fixture(scope="session")
def tar_ds(folder_ds, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tar")
    shards = folder_to_tar(folder_ds, out, samples_per_shard=50)
    assert len(shards) == 3
    return out


@pytest.fixture(scope="session")
def parquet_ds(folder_ds, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parquet")
    # ~8 rows per row group: several files and several row groups per file.
    files = folder_to_parquet(folder_ds, out, rows_per_file=50, row_group_bytes=8 * 40_000)
    assert len(files) == 3
    assert pq.ParquetFile(files[0]).num_row_groups > 1
    return out


@pytest.fixture(scope="session")
def sources(folder_ds, tar_ds, parquet_ds):
    """``{format: opened source}`` for the same data."""
    from feedgpu import FolderSource, ParquetSource, TarShardSource

    return {"folder": FolderSource(folder_ds), "tar": TarShardSource(tar_ds), "parquet": ParquetSource(parquet_ds)}


# -- a dataset mixing every hard case with good photos, in every format --------------------------
N_GOOD = 24


def _good_photo_bytes(folder: Path, n: int) -> list[bytes]:
    files = sorted(folder.rglob("*.jpg"))[:n]
    return [f.read_bytes() for f in files]


def write_cases_dataset(root: Path, good: list[bytes], fmt: str) -> Path:
    """Class 0 ``cases`` holds every case file (names kept), class 1 ``good`` holds good photos.

    Written by hand (not through feedgpu.convert) so that the zero-byte file reaches the tar
    shard and the Parquet column too.
    """
    items = [(f"cases/{name}", (CASES / name).read_bytes(), 0) for name in case_files()]
    items += [(f"good/good_{i:03d}.jpg", data, 1) for i, data in enumerate(good)]
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "folder":
        for rel, data, _ in items:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
    elif fmt == "tar":
        with tarfile.open(root / "cases-000000.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for rel, data, label in items:
                stem, ext = rel.rsplit(".", 1)
                # WebDataset keys end at the first dot: keep the full name readable in the key.
                for name, blob in ((f"{stem}.{ext}", data), (f"{stem}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
    elif fmt == "parquet":
        table = pa.table({"key": [rel for rel, _, _ in items],
                          "image": pa.array([d for _, d, _ in items], pa.large_binary()),
                          "label": pa.array([lab for _, _, lab in items], pa.int64())})
        pq.write_table(table, root / "cases.parquet", row_group_size=10)
    else:  # pragma: no cover
        raise ValueError(fmt)
    return root


@pytest.fixture(scope="session")
def cases_datasets(folder_ds, tmp_path_factory) -> dict[str, Path]:
    good = _good_photo_bytes(folder_ds, N_GOOD)
    base = tmp_path_factory.mktemp("cases")
    return {fmt: write_cases_dataset(base / fmt, good, fmt) for fmt in ("folder", "tar", "parquet")}


def open_format(fmt: str, path: Path):
    import warnings

    from feedgpu.sources import open_source

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the empty file is reported while indexing
        return open_source(fmt, path)


# -- processes ------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    """True while ``pid`` is a running (not zombie) process."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` runs; return those still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def sticks_once(marker: str, real):
    """A worker target that, in the first process started, never gets to feedgpu's worker code
    (as a child deadlocked in the interpreter's after-fork handler: it runs nothing), and runs
    ``real`` in every other. Put it in place of a pool's target with ``monkeypatch``; with fork
    the children inherit it."""
    def main(*args):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return real(*args)
        time.sleep(3600)
    return main


def child_pids() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE}


@pytest.fixture
def no_leaked_workers():
    """Fails the test when it leaves worker processes behind."""
    before = child_pids()
    yield
    import gc

    gc.collect()  # an exception's traceback can hold a loader in a reference cycle (as torch's)
    left = wait_gone(child_pids() - before, timeout=10.0)
    assert not left, f"worker processes left behind: {left}"


#: Ray clusters started by the tests talk over the loopback address: without this Ray uses the
#: host's network address for its own processes (this switch is Ray's single-node mode). Ray
#: reads it when imported, so it is set here, before any test module imports ray; only Ray reads it.
#: Ray runs its worker processes at niceness 15 unless told otherwise (``RAY_worker_niceness``,
#: read when a cluster starts): on a machine whose cores other processes keep busy those workers
#: get almost no CPU, and a test waits minutes for a remote worker to start; the test clusters
#: run them at the training process's priority, as local workers run.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_worker_niceness": "0"}
os.environ.update(RAY_LOOPBACK_ENV)


@pytest.fixture(scope="module")
def ray_cluster():
    """A small local Ray cluster (2 CPUs, no dashboard, 500 MB object store, loopback only) for
    one test module; its workers import feedgpu and the tests from the repository under test."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=500 * 2**20,
             log_to_driver=False, namespace="feedgpu",
             runtime_env={"env_vars": {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}:{REPO / 'tests' / 'integration'}"}})
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        yield ray
    finally:
        ray.shutdown()


def batches_equal(a, b) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x.images, y.images) and torch.equal(x.labels, y.labels)
                                    for x, y in zip(a, b))


def clone_all(loader) -> list:
    """Iterate ``loader`` to the end of its epoch, cloning each batch as it comes."""
    from feedgpu import Batch

    return [Batch(b.images.clone(), b.labels.clone()) for b in loader]
