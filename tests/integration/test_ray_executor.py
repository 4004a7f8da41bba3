"""``executor: ray``: batches computed by remote workers on a local Ray cluster (started here,
2 CPUs, no dashboard) equal the local pool's bit for bit, in order, sharded, resumable; dead
remote workers are replaced and their batches redone; the balancer borrows remote workers."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter

import functools

import numpy as np
import pytest
import ray
import torch
import torch.utils.data as tud

from conftest import REPO, batches_equal, clone_all
from feedgpu import Batch, ConfigError, DataLoader, Pipeline, StageError, WorkerError
from feedgpu.stages import Decode, HorizontalFlip, Normalize, PythonStage, RandomResizedCrop, ResizeCenterCrop

# Ray starts its worker processes slowly when other processes hold the cores: the waits below are
# hang guards sized for a busy machine, not speed checks (each loop ends as soon as its event comes)
RAY_WAIT_S = 300
pytestmark = pytest.mark.timeout(3 * RAY_WAIT_S)

RAY = {"name": "ray", "remote_workers": 2}


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    """Every test here runs on the module's local Ray cluster (conftest.ray_cluster)."""
    return ray_cluster


def train(src, **kw) -> Pipeline:
    opts = dict(batch_size=16, num_workers=2, seed=3, device="cpu")
    opts.update(kw)
    return Pipeline(src, [Decode(), RandomResizedCrop(48), HorizontalFlip(), Normalize()], **opts)


def one_epoch(loader, epoch: int = 1) -> list[Batch]:
    loader.set_epoch(epoch)
    out = clone_all(loader)
    loader.shutdown()
    return out


# -- same batches as the local pool ----------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["folder", "tar", "parquet"])
def test_remote_only_batches_equal_the_local_pool_bitwise(sources, fmt):
    s = sources[fmt]
    local = one_epoch(DataLoader(train(s)))
    loader = DataLoader(train(s, num_workers=0, executor=RAY))
    remote = one_epoch(loader)
    assert batches_equal(remote, local)
    st = loader.stats()["executor"]
    assert st["name"] == "ray" and st["local_batches"] == 0 and st["remote_batches"] >= len(local)


def test_local_and_remote_workers_together_equal_the_local_pool(sources):
    s = sources["folder"]
    reference = DataLoader(train(s))
    loader = DataLoader(train(s, num_workers=1, prefetch_factor=4), executor={"name": "ray", "remote_workers": 1})
    # batches go to the local worker until Ray has started the remote one (a few seconds):
    # every epoch equals the local pool's, before and after
    deadline, epoch = time.monotonic() + RAY_WAIT_S, 0
    while True:
        reference.set_epoch(epoch)
        loader.set_epoch(epoch)
        assert batches_equal(clone_all(loader), clone_all(reference)), f"epoch {epoch}"
        st = loader.stats()["executor"]
        if st["remote_batches"] >= 4 or time.monotonic() > deadline:
            break
        epoch += 1
    loader.shutdown()
    reference.shutdown()
    assert st["local_batches"] > 0 and st["remote_batches"] >= 4, st


def test_a_remote_worker_the_cluster_cannot_place_holds_no_batch_back(sources):
    s = sources["folder"]
    want = one_epoch(DataLoader(train(s, num_workers=1)))
    # 3 CPUs per remote worker on a 2-CPU cluster: Ray keeps it pending for ever
    loader = DataLoader(train(s, num_workers=1), executor={"name": "ray", "remote_workers": 1, "cpus_per_worker": 3})
    loader.set_epoch(1)
    got = clone_all(loader)
    st = loader.stats()["executor"]
    loader.shutdown()
    assert batches_equal(got, want)
    assert (st["remote_workers"], st["remote_started"], st["remote_batches"]) == (1, 0, 0), st


def test_pipeline_yaml_executor_ray(folder_ds, tmp_path):
    y = tmp_path / "p.yaml"
    y.write_text(textwrap.dedent(f"""
        version: 1
        source: {{format: folder, path: {folder_ds}}}
        stages: [{{op: decode}}, {{op: resize_center_crop, resize: 40, crop: 32}}]
        loader: {{batch_size: 20, num_workers: 0, shuffle: false}}
        output: {{device: cpu, dtype: uint8, layout: NHWC}}
        executor: {{name: ray, address: null, remote_workers: 2}}
    """))
    p = Pipeline.from_yaml(y)
    assert p.executor.name == "ray" and p.executor.remote_workers == 2
    got = one_epoch(DataLoader(p))
    want = one_epoch(DataLoader(Pipeline.from_yaml(y, executor="local", **{"loader.num_workers": 1})))
    assert batches_equal(got, want) and got[0].images.shape == (20, 32, 32, 3)


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_gets_its_shard_with_equal_batch_counts(sources, world_size):
    s = sources["folder"]
    seen = []
    for rank in range(world_size):
        kw = dict(rank=rank, world_size=world_size)
        local = one_epoch(DataLoader(train(s, drop_last=False), **kw))
        loader = DataLoader(train(s, num_workers=0, drop_last=False), executor=RAY, **kw)
        remote = one_epoch(loader)
        assert len(remote) == len(loader) == len(local)
        assert batches_equal(remote, local)
        seen.append(torch.cat([b.labels for b in remote]))
    assert len({len(x) for x in seen}) == 1, "every rank gets as many samples"


def test_resume_mid_epoch_gives_the_next_batch(sources):
    s = sources["parquet"]
    full = DataLoader(train(s))
    reference = one_epoch(full, epoch=4)

    first = DataLoader(train(s, num_workers=1), executor=RAY)
    first.set_epoch(4)
    it = iter(first)
    head = [Batch(b.images.clone(), b.labels.clone()) for b in (next(it) for _ in range(3))]
    state = first.state_dict()
    assert (state["epoch"], state["batches_seen"]) == (4, 3)
    first.shutdown()
    del it

    again = DataLoader(train(s, num_workers=0), executor={"name": "ray", "remote_workers": 1})
    again.load_state_dict(state)
    tail = clone_all(again)
    again.shutdown()
    assert batches_equal(head + tail, reference)
    labels = torch.cat([b.labels for b in head + tail]).tolist()
    assert Counter(labels) == Counter(torch.cat([b.labels for b in reference]).tolist())


class Squares(tud.Dataset):
    def __len__(self):
        return 30

    def __getitem__(self, i):
        return torch.tensor([i, i * i]), float(np.random.rand())  # numpy's RNG: each worker's, as in torch


def test_torch_dataset_runs_remotely_with_the_same_batches():
    """The same samples in the same batches; the dataset's own random draws follow each worker's
    seeding (torch's for local workers), so they are not compared."""
    local = clone_tensors(DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=1, seed=5))
    remote = clone_tensors(DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=0, seed=5, executor=RAY))
    assert len(local) == len(remote) == 8
    for a, b in zip(local, remote):
        assert torch.equal(a[0], b[0]) and a[1].dtype == b[1].dtype and len(a[1]) == len(b[1])


def clone_tensors(loader) -> list:
    out = [[x.clone() for x in b] for b in loader]
    loader.shutdown()
    return out


# -- errors and faults -----------------------------------------------------------------------------
def fail_on_label_three(img):
    raise_if = np.asarray(img)[0, 0, 0] == 3
    if raise_if:
        raise ValueError("user stage cannot take sample three")
    return img


class Painted(tud.Dataset):
    """Item i: an 8x8 image whose pixels all hold i."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return np.full((8, 8, 3), i, np.uint8), i


def painted(fn, name: str | None = None, **kw) -> Pipeline:
    opts = dict(batch_size=4, shuffle=False, num_workers=0, device="cpu", on_error="raise")
    opts.update(kw)
    stage = PythonStage(fn, name=name or fn.__name__)
    return Pipeline(Painted(), [Decode(), ResizeCenterCrop(8, 8), stage], **opts)


def test_a_remote_stage_error_is_raised_in_order_with_its_type():
    loader = DataLoader(painted(fail_on_label_three), executor=RAY)
    with pytest.raises(StageError, match="fail_on_label_three"):
        for _ in loader:
            pass
    # batch 0 holds sample three: it raised and, as torch moves past a failed batch, counts as consumed
    assert loader.state_dict()["batches_seen"] == 1


def exit_once(img, marker: str):
    """Kills the process it runs in at its first call on sample 9 (a marker file says it did)."""
    if np.asarray(img)[0, 0, 0] == 9 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return img


def identity(img):
    return img


def test_a_remote_worker_that_dies_is_replaced_and_its_batches_redone(tmp_path):
    marker = tmp_path / "died"
    want = one_epoch(DataLoader(painted(identity, num_workers=1)))
    loader = DataLoader(painted(functools.partial(exit_once, marker=str(marker)), name="exit_once"), executor=RAY)
    got = one_epoch(loader)
    assert marker.exists(), "a remote worker died"
    assert [b.labels.tolist() for b in got] == [b.labels.tolist() for b in want], "none lost, none repeated"
    assert batches_equal(got, want)
    st = loader.stats()["executor"]
    assert st["retries"] >= 1 and st["respawns"] == 1
    assert list(st["retry_reasons"]) == [r for r in st["retry_reasons"] if r.startswith("worker process died")]
    assert any(r[1] == 2 for r in st["retried"]), "batch 2 (samples 8-11) was redone"


def test_an_actor_killed_mid_epoch_loses_and_repeats_nothing(sources):
    s = sources["folder"]
    want = one_epoch(DataLoader(train(s, batch_size=8)))
    loader = DataLoader(train(s, batch_size=8, num_workers=0, prefetch_factor=3), executor=RAY)
    loader.set_epoch(1)
    got = []
    for i, b in enumerate(loader):
        got.append(Batch(b.images.clone(), b.labels.clone()))
        if i == 1:
            names = loader.stats()["executor"]["remote_names"]
            ray.kill(ray.get_actor(names[0], namespace="feedgpu"))
    loader.shutdown()
    assert batches_equal(got, want)
    st = loader.stats()["executor"]
    assert st["retries"] >= 1 and any("ray.kill" in r for r in st["retry_reasons"]), st["retry_reasons"]


def exit_always(img):
    if np.asarray(img)[0, 0, 0] == 5:
        os._exit(1)
    return img


def test_a_sample_that_kills_every_remote_worker_raises_worker_error():
    loader = DataLoader(painted(exit_always), executor=RAY)
    with pytest.raises(WorkerError, match="batch 1 has now lost 2 workers"):
        for _ in loader:
            pass


def stuck(img):
    time.sleep(30)
    return img


def test_a_stuck_remote_batch_raises_loader_timeout_naming_the_remote_worker():
    from feedgpu import LoaderTimeout

    loader = DataLoader(painted(stuck, timeout=2.0), executor={"name": "ray", "remote_workers": 1})
    t0 = time.monotonic()
    with pytest.raises(LoaderTimeout, match=r"remote worker feedgpu-\w+-0 \((started|not started).*\) holds batch"):
        next(iter(loader))
    assert time.monotonic() - t0 < 25, "raised at the timeout, not when the stage returned"
    loader.shutdown()


def test_executor_settings_errors(sources):
    s = sources["folder"]
    with pytest.raises(ConfigError, match="remote_workers >= 1"):
        DataLoader(train(s, num_workers=0), executor={"name": "ray", "remote_workers": 0})
    with pytest.raises(ConfigError, match="cache"):
        DataLoader(train(s), executor="ray", cache=True)
    with pytest.raises(ConfigError, match="engine 'dali'"):
        Pipeline(s, [Decode(), ResizeCenterCrop(40, 32)], engine="dali", executor="ray")
    with pytest.raises(ConfigError, match="executor.name: Input should be 'local' or 'ray' \\(got 'spark'\\)"):
        DataLoader(train(s), executor="spark")


# -- the balancer borrows remote workers -------------------------------------------------------------
def sleepy(img):
    time.sleep(0.01)  # ~100 samples/s per worker whatever the cores: remote workers add throughput
    return img


def test_balancer_adds_remote_workers_when_local_ones_are_capped_and_releases_them(sources):
    s = sources["folder"]
    pipe = Pipeline(s, [Decode(), ResizeCenterCrop(40, 32), PythonStage(sleepy, name="sleepy")], batch_size=8,
                    num_workers="auto", seed=0, device="cpu", executor={"name": "ray", "max_remote_workers": 2,
                                                                        "max_local_workers": 1})
    loader = DataLoader(pipe)
    a = loader.balancer
    a.window_s, a.min_batches = 0.3, 2
    epoch = 0
    deadline = time.monotonic() + RAY_WAIT_S
    def kept_add():
        return any(p["reason"].startswith("kept: 0 -> 1 remote") for p in a.timeline)

    while not kept_add() and time.monotonic() < deadline:   # an unlimited consumer: it always waits
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        epoch += 1
    kinds = [p["decision"] for p in a.timeline]
    assert "remote-add" in kinds and kept_add(), [(p["decision"], p["reason"]) for p in a.timeline]
    assert a.remote >= 1 and loader.stats()["executor"]["remote_workers"] == a.remote
    assert all(p["next_workers"] == 1 for p in a.timeline), "local workers stay at max_local_workers"
    add = next(p for p in a.timeline if p["decision"] == "remote-add")
    assert "cannot grow" in add["reason"] and "configured maximum (1 workers)" in add["reason"]

    # a slow consumer (20 samples/s, far below one worker's 100): remote workers are released
    while a.remote > 0 and time.monotonic() < deadline + RAY_WAIT_S:
        loader.set_epoch(epoch)
        for _ in loader:
            time.sleep(0.4)
        epoch += 1
    assert a.remote == 0 and "remote-remove" in [p["decision"] for p in a.timeline], \
        [(p["decision"], p["reason"]) for p in a.timeline]
    assert loader.stats()["executor"]["remote_workers"] == 0
    loader.shutdown()


#: a 4-sample pipeline with executor ray, for the tests that run in a fresh interpreter
_FOUR_PIPELINE = textwrap.dedent("""
    import feedgpu
    from feedgpu.stages import Decode, ResizeCenterCrop
    import numpy as np

    class Four:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.zeros((8, 8, 3), np.uint8), i

    p = feedgpu.Pipeline(Four(), [Decode(), ResizeCenterCrop(8, 8)],
                         batch_size=2, num_workers=0, device="cpu", executor="ray")
""")


def test_import_feedgpu_without_ray():
    code = "import sys\nsys.modules['ray'] = None   # import ray raises ImportError\n" + _FOUR_PIPELINE + \
        textwrap.dedent("""
        try:
            feedgpu.DataLoader(p, executor={"name": "ray", "remote_workers": 1})._backend.acquire_pool()
        except feedgpu.ConfigError as e:
            print("ConfigError:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=RAY_WAIT_S,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert "pip install 'feedgpu[ray]'" in out.stdout



def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}", "no-such-host.invalid:6379"])
def test_an_unreachable_address_raises_config_error_quickly(address):
    """A HOST:PORT where no cluster listens: ConfigError naming the address within seconds, not
    ray.init's endless "Failed to get cluster ID from GCS server" retries (checked in a fresh
    process: this one has joined the module's cluster, and connect() then returns at once)."""
    address = address.format(port=_closed_port())
    code = "import time\n" + _FOUR_PIPELINE + textwrap.dedent(f"""
        t = time.monotonic()
        try:
            feedgpu.DataLoader(p, executor={{"name": "ray", "address": {address!r}, "remote_workers": 1}})._backend.acquire_pool()
        except feedgpu.ConfigError as e:
            print("ConfigError:", e)
        print("seconds", time.monotonic() - t)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=RAY_WAIT_S,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert f"ConfigError: executor.address {address!r}: cannot join the Ray cluster" in out.stdout, out.stdout
    assert float(out.stdout.split("seconds")[-1]) < 20

def square_or_exit(task, marker: str):
    """A RemoteWorkers handler: ``task[2] ** 2``; kills its process once on 3 (marker file)."""
    if task[2] == 3 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return task[2] ** 2


def test_a_retiring_remote_worker_that_dies_has_its_batches_finished_and_goes(tmp_path):
    from feedgpu.exec.executors import ExecutorSettings
    from feedgpu.exec.remote.ray_workers import RemoteWorkers

    rw = RemoteWorkers(functools.partial(square_or_exit, marker=str(tmp_path / "died")), 1, ExecutorSettings("ray"))
    try:
        for seq in range(6):
            rw.submit((1, seq, seq))
        rw.resize(0)    # released once its calls are done; it dies on the 4th one
        assert rw.num_workers == 0
        got = {}
        deadline = time.monotonic() + RAY_WAIT_S
        while len(got) < 6 and time.monotonic() < deadline:
            r = rw.poll(block_s=1.0)
            if r is not None:
                assert r[3], r
                got[r[1]] = r[4]
        assert got == {s: s * s for s in range(6)}, "every call answered once"
        st = rw.stats()
        assert st["retries"] >= 1 and st["respawns"] == 1 and st["workers"] == 0
        assert list(st["retry_reasons"])[0].startswith("worker process died")
        deadline = time.monotonic() + 10
        while rw._workers and time.monotonic() < deadline:   # the helper goes once it is done
            rw.poll(block_s=0.2)
        assert not rw._workers and not rw._gone
    finally:
        rw.close()
