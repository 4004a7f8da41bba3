#!/usr/bin/env python
"""Remote shards behind a rate-limited HTTP link: does the loader keep a CPU-bound pipeline fed?

    .venv/bin/python bench/remote.py                    # ~12 min on the 2-core dev machine
    .venv/bin/python bench/remote.py --images 1200 --rounds 2 --factors 0.5,1,2,4

Data: ``--images`` ImageNet-like JPEGs (400-640 px, built from the photographs in
``/work/shared/data/photos`` or the package's) converted to tar shards of ``--per-shard`` samples
with ``feedgpu convert``'s writer (``_index.json`` beside them), served on loopback by
:class:`RateServer`: Python's HTTP server with Range requests and ETags, every GET body written in
64 KiB blocks through one token bucket of ``rate`` bytes/s shared by all connections (the link).

Pipeline (CPU-bound, on the CPU): decode -> resize (short side 80) -> [pixel cache point] ->
random resized crop 64 -> flip -> normalize, ``--workers`` workers (fixed, not ``auto``, so every
setting runs the same pool), batch ``--batch``, ``persistent_workers=False``.

First a calibration epoch from the local shards gives the pipeline's byte rate B (shard bytes /
epoch seconds); the link rates are ``--factors`` x B, fixed for the whole run. Then, per round,
in turn (the order of the settings rotates per round):

* ``local``: the shards on local disk, plain shuffle and ``shuffle: shards`` (the reference rate);
* ``net <f>x``: epoch 1 over the link at ``f`` x B, from an empty shard cache folder, with the
  plain shuffle and with ``shuffle: shards`` (``shard_window`` ``--window``);
* ``shard cache``: epoch 2 of the ``net`` loader at the highest factor (its shard cache is full):
  the run asserts the server saw no GET of a shard during it;
* ``pixel cache``: a loader with ``cache:`` over the link: epoch 1 fills the pixel cache, epoch 2
  (``pixel cache``) reads decoded pixels (asserted: no GET, nothing decoded).

Each epoch is timed from ``iter(loader)`` to its last batch (worker start-up included; the
consumer only drops the batches). Reported: samples/s (median, per-round range), the ratio to the
``local`` rate of the same shuffle in the same round, and from ``loader.stats()["network"]`` the
bytes downloaded, the main process's blocked wait for shards and the workers' own download waits.
Results: ``bench/results/remote.{json,md}``; the conclusions in the .md are written by hand.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))   # this checkout's feedgpu


class TokenBucket:
    """``rate`` bytes/s (None: unlimited), bursts of at most ``burst`` bytes, shared by threads."""

    def __init__(self, rate: float | None, burst: int = 256 << 10):
        self.rate, self.burst = rate, burst
        self.tokens, self.t = float(burst), time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
                self.t = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                short = (n - self.tokens) / self.rate
            time.sleep(short)


class RateServer:
    """Files under ``root`` at ``http://127.0.0.1:PORT/<path>`` (HEAD, GET, Range, ETag), GET
    bodies through one :class:`TokenBucket` (``rate`` settable while it runs). ``gets``: GETs per
    file name; ``bytes_sent``: GET body bytes."""

    BLOCK = 64 << 10

    def __init__(self, root, rate: float | None = None):
        self.root = Path(root)
        self.bucket = TokenBucket(rate)
        self.gets: dict[str, int] = {}
        self.bytes_sent = 0
        self._lock = threading.Lock()
        self._etags: dict[str, str] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                server._serve(self, False)

            def do_GET(self):
                server._serve(self, True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def set_rate(self, rate: float | None) -> None:
        self.bucket = TokenBucket(rate)

    def shard_gets(self) -> int:
        with self._lock:
            return sum(v for k, v in self.gets.items() if k.endswith(".tar"))

    def _etag(self, path: Path) -> str:
        key = str(path)
        if key not in self._etags:
            h = hashlib.md5()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            self._etags[key] = '"' + h.hexdigest() + '"'
        return self._etags[key]

    def _serve(self, h, body: bool) -> None:
        name = h.path.lstrip("/").split("?")[0]
        path = self.root / name
        if body:
            with self._lock:
                self.gets[name] = self.gets.get(name, 0) + 1
        if not path.is_file():
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        size = path.stat().st_size
        start, end = 0, size
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else max(0, size - int(b))
            end = min(size, int(b) + 1) if a and b else size
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        else:
            h.send_response(200)
        h.send_header("Content-Length", str(end - start))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("ETag", self._etag(path))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if not body:
            return
        bucket = self.bucket
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start
            while left > 0:
                block = f.read(min(self.BLOCK, left))
                bucket.take(len(block))
                h.wfile.write(block)
                left -= len(block)
                with self._lock:
                    self.bytes_sent += len(block)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def make_data(root: Path, images: int, per_shard: int) -> Path:
    from feedgpu.convert import folder_to_tar
    from feedgpu.sample_data import build_imagenet_like

    photos = Path("/work/shared/data/photos")
    folder = build_imagenet_like(root / "train", images, photos_dir=photos if photos.is_dir() else None, seed=0)
    out = root / "www" / "tar"
    if not (out / "_index.json").exists():
        folder_to_tar(folder, out, samples_per_shard=per_shard)
    return out


def pipeline(source, shuffle, args, cache=None):
    from feedgpu import Pipeline
    from feedgpu.stages import Decode, HorizontalFlip, Normalize, RandomResizedCrop, Resize

    stages = [Decode(), Resize(80), RandomResizedCrop(64), HorizontalFlip(), Normalize()]
    return Pipeline(source, stages, batch_size=args.batch, num_workers=args.workers, shuffle=shuffle,
                    shard_window=args.window, seed=0, device="cpu", drop_last=False, persistent_workers=False,
                    cache=cache)


def epoch(loader) -> dict:
    t0 = time.perf_counter()
    n = 0
    for images, labels in loader:
        n += len(labels)
    wall = time.perf_counter() - t0
    return {"samples": n, "wall_s": round(wall, 3), "samples_per_s": round(n / wall, 1)}


def net_figures(before: dict | None, after: dict | None) -> dict:
    if after is None:
        return {}
    b = before or {}
    keys = ("bytes_downloaded", "misses", "hits", "read_ahead_wait_s", "worker_wait_s", "retries")
    return {k: round(after.get(k, 0) - b.get(k, 0), 3) for k in keys}


def run_local(shards: Path, shuffle, args) -> dict:
    from feedgpu import DataLoader, TarShardSource

    loader = DataLoader(pipeline(TarShardSource(shards), shuffle, args))
    r = epoch(loader)
    loader.shutdown()
    return r


def run_net(server: RateServer, rate, shuffle, args, tmp: Path, second: bool = False) -> list[dict]:
    from feedgpu import DataLoader, TarShardSource

    server.set_rate(rate)
    cache_dir = Path(tempfile.mkdtemp(dir=tmp, prefix="shards-"))
    src = TarShardSource(f"{server.url}/tar/_index.json", cache_dir=cache_dir)
    loader = DataLoader(pipeline(src, shuffle, args))
    out = []
    gets0 = server.shard_gets()
    r = epoch(loader)
    st = loader.stats()["network"]
    r.update(net_figures(None, st), shard_gets=server.shard_gets() - gets0)
    out.append(r)
    if second:   # epoch 2: the shard cache is full
        gets1 = server.shard_gets()
        r2 = epoch(loader)
        r2.update(net_figures(st, loader.stats()["network"]), shard_gets=server.shard_gets() - gets1)
        assert r2["shard_gets"] == 0, f"epoch 2 from the shard cache sent {r2['shard_gets']} GETs"
        out.append(r2)
    loader.shutdown()
    shutil.rmtree(cache_dir, ignore_errors=True)
    return out


def run_pixel(server: RateServer, rate, args, tmp: Path) -> list[dict]:
    from feedgpu import DataLoader, TarShardSource

    server.set_rate(rate)
    cache_dir = Path(tempfile.mkdtemp(dir=tmp, prefix="shards-"))
    px = Path(tempfile.mkdtemp(dir=tmp, prefix="pixels-"))
    out = []
    for k in range(2):   # epoch 1 fills the pixel cache (its workers write it when they exit)
        src = TarShardSource(f"{server.url}/tar/_index.json", cache_dir=cache_dir)
        loader = DataLoader(pipeline(src, "shards", args, cache={"dir": str(px)}))
        gets0 = server.shard_gets()
        r = epoch(loader)
        st = loader.stats()
        loader.shutdown()
        r.update(net_figures(None, st["network"]), shard_gets=server.shard_gets() - gets0,
                 decode_s=round(st["stage_s"].get("decode", 0.0), 3))
        out.append(r)
    assert out[1]["shard_gets"] == 0 and out[1]["decode_s"] == 0, f"pixel-cache epoch read shards: {out[1]}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    shutil.rmtree(px, ignore_errors=True)
    return out


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "rounds": [round(v, 3) for v in values]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1600)
    ap.add_argument("--per-shard", type=int, default=50)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--factors", default="0.5,1,2,4")
    ap.add_argument("--data", default=None, help="folder for the built data (default: a temporary one)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    factors = [float(f) for f in args.factors.split(",")]
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="feedgpu-remote-bench-"))
    root = Path(args.data) if args.data else tmp
    shards = make_data(root, args.images, args.per_shard)
    shard_bytes = sum(p.stat().st_size for p in shards.glob("*.tar"))
    server = RateServer(shards.parent)
    try:
        calib = run_local(shards, True, args)
        byte_rate = shard_bytes / calib["wall_s"]
        print(f"calibration: {calib}, byte rate {byte_rate / 1e6:.2f} MB/s", file=sys.stderr)
        settings = [("local", None, s) for s in (True, "shards")]
        settings += [(f"net {f:g}x", f, s) for f in factors for s in (True, "shards")]
        settings += [("pixel cache", max(factors), "shards")]
        runs: dict[str, list] = {}
        loads = []
        for rnd in range(args.rounds):
            k = rnd % len(settings)
            for name, f, shuffle in settings[k:] + settings[:k]:
                label = f"{name} | {'shards' if shuffle == 'shards' else 'plain'}"
                if name == "local":
                    res = [run_local(shards, shuffle, args)]
                elif name == "pixel cache":
                    fill, read = run_pixel(server, f * byte_rate, args, tmp)
                    runs.setdefault("pixel fill (epoch 1) | shards", []).append(dict(fill, round=rnd))
                    res = [read]
                else:
                    res = run_net(server, f * byte_rate, shuffle, args, tmp, second=(f == max(factors)))
                    if len(res) == 2:
                        runs.setdefault(f"shard cache (epoch 2) | {'shards' if shuffle == 'shards' else 'plain'}",
                                        []).append(dict(res[1], round=rnd))
                runs.setdefault(label, []).append(dict(res[0], round=rnd))
                loads.append(os.getloadavg()[0])
                print(f"round {rnd} {label}: {res}", file=sys.stderr)
    finally:
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    table = {}
    for label, rs in runs.items():
        shuffle = label.split("| ")[1]
        local = {r["round"]: r["samples_per_s"] for r in runs[f"local | {shuffle}"]}
        row = {"samples_per_s": summary([r["samples_per_s"] for r in rs]),
               "vs_local": summary([r["samples_per_s"] / local[r["round"]] for r in rs]),
               "wall_s": summary([r["wall_s"] for r in rs])}
        for key in ("bytes_downloaded", "read_ahead_wait_s", "worker_wait_s", "shard_gets"):
            if key in rs[0]:
                row[key] = summary([r[key] for r in rs])
        table[label] = row
    doc = {"benchmark": "bench/remote.py", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "shared": "shared with other agents' work while it ran",
                       "load_average_start": [round(x, 2) for x in load0],
                       "load_average_during": summary(loads)},
           "settings": {**vars(args), "factors": factors, "shard_bytes": shard_bytes,
                        "shards": len(list(shards.glob("*.tar"))),
                        "pipeline": "decode -> resize 80 -> [cache] -> random_resized_crop 64 -> flip -> normalize",
                        "calibration": calib, "byte_rate_Bps": round(byte_rate),
                        "link_rates_Bps": {f"{f:g}x": round(f * byte_rate) for f in factors}},
           "results": table, "runs": runs, "total_seconds": round(time.perf_counter() - t_start, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "remote.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(markdown(doc))
    print(f"wrote {out / 'remote.json'} ({doc['total_seconds']:.0f} s); write remote.md by hand", file=sys.stderr)


def markdown(doc: dict) -> str:
    """The figures as a table (the .md adds the conclusions by hand)."""
    lines = ["| setting | samples/s median (range) | vs local, same round | epoch s | MB downloaded | "
             "main blocked s | worker wait s | shard GETs |", "|---|---|---|---|---|---|---|---|"]
    for label, row in doc["results"].items():
        def cell(key, scale=1.0, fmt="{:.2f}"):
            if key not in row:
                return "-"
            s = row[key]
            return f"{fmt.format(s['median'] * scale)} ({fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)})"
        lines.append(f"| {label} | {cell('samples_per_s', fmt='{:.0f}')} | {cell('vs_local')} | "
                     f"{cell('wall_s', fmt='{:.1f}')} | {cell('bytes_downloaded', 1e-6, '{:.0f}')} | "
                     f"{cell('read_ahead_wait_s')} | {cell('worker_wait_s')} | {cell('shard_gets', fmt='{:.0f}')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
