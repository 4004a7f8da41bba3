"""The multi-node setup of docs/guides/ray.md, on one node: a cluster started with ``ray start --head`` (its
own processes, its own port), and a training process that joins it through
``executor.address`` and gets the same batches as the local pool."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import RAY_LOOPBACK_ENV, REPO

pytestmark = pytest.mark.timeout(180)
RAY = Path(sys.executable).parent / "ray"
#: Ray's token authentication, as on a real cluster: the head and the training process share a
#: token (here in RAY_AUTH_TOKEN; ~/.ray/auth_token is left alone).
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def head():
    """``ray start --head --block`` on a free port (2 CPUs, no dashboard); stopped, with every
    process it started, at the end."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), **RAY_LOOPBACK_ENV, **AUTH}
    proc = subprocess.Popen([str(RAY), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", "--object-store-memory=300000000",
                             "--node-ip-address=127.0.0.1", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while not listening(port):
        assert proc.poll() is None, f"ray start failed: {proc.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, "ray start --head did not listen within 60 s"
        time.sleep(0.5)
    yield f"127.0.0.1:{port}"
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)    # --block: ray stops the processes it started
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    _, alive = psutil.wait_procs(children, timeout=15)
    for p in alive:
        p.kill()
    # ray start records the cluster for later `ray.init()` calls on this node: not once it is gone
    current = Path("/tmp/ray/ray_current_cluster")
    if current.exists() and current.read_text().strip().endswith(f":{port}"):
        current.unlink()
    assert not alive, f"processes of the head left running: {[p.pid for p in alive]}"


def test_a_training_process_joins_a_cluster_started_with_ray_start(head, folder_ds):
    code = textwrap.dedent(f"""
        import json, torch, ray
        import feedgpu
        from feedgpu.stages import Decode, RandomResizedCrop
        def pipe(**kw):
            return feedgpu.Pipeline(feedgpu.FolderSource({str(folder_ds)!r}), [Decode(), RandomResizedCrop(32)],
                                    batch_size=16, seed=7, device="cpu", **kw)
        remote = feedgpu.DataLoader(pipe(num_workers=0, executor={{"name": "ray", "address": {head!r},
                                                                    "remote_workers": 2}}))
        got = [(b.images.clone(), b.labels.clone()) for b in remote]
        st = remote.stats()["executor"]
        remote.shutdown()
        want = [(b.images.clone(), b.labels.clone()) for b in feedgpu.DataLoader(pipe(num_workers=1))]
        same = len(got) == len(want) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                             for a, b in zip(got, want))
        print(json.dumps({{"same": same, "batches": len(got), "remote_batches": st["remote_batches"],
                          "gcs": ray.get_runtime_context().gcs_address}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), **RAY_LOOPBACK_ENV, **AUTH})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["same"] and r["batches"] == 8 and r["remote_batches"] >= 8, r   # 120 samples, batches of 16
    assert r["gcs"] == head, "joined the cluster named by executor.address, not a new one"
