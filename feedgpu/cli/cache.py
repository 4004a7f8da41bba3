"""``feedgpu cache build|verify|info|clear`` and ``feedgpu convert``."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import click


def _root(cache_dir: str | None) -> Path:
    from ..cache.settings import default_cache_root

    return Path(cache_dir).expanduser() if cache_dir else default_cache_root()


def _index_dir(index_dir: str | None) -> Path:
    """Where folder sources save their indexes (:mod:`feedgpu.sources.folder_index`)."""
    from ..sources.folder_index import default_index_dir

    return Path(index_dir).expanduser() if index_dir else default_index_dir()


def _tar_index_dir() -> Path:
    """Where tar sources save their shards' indexes (:mod:`feedgpu.sources.tar.index`)."""
    from ..sources.tar.index import default_index_dir

    return default_index_dir()


_INDEX_DIR_HELP = ("Folder of the saved folder-source indexes (default: <feedgpu cache dir>/folder-index; "
                   "--cache-dir does not move it).")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@click.group()
def cache() -> None:
    """Build, check, list and delete cached pipeline prefixes."""


@cache.command("build")
@click.option("--pipeline", "pipeline_file", type=click.Path(exists=True, dir_okay=False), required=True)
@click.option("--data", type=click.Path(exists=True), help="Dataset path (sets source.path).")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="Cache root (default: the pipeline's or the user cache).")
@click.option("--compression", help="none or zstd:N (default: the pipeline's, else none).")
@click.option("--workers", type=int, default=None, help="Worker processes (default: the pipeline's).")
@click.option("--fingerprint", metavar="metadata|content",
              help="What ties the entry to the data: metadata (stat of each file, default) or content "
                   "(a hash of each file's bytes); the loader must use the same (cache.fingerprint).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a pipeline key.")
def build_cmd(pipeline_file, data, cache_dir, compression, workers, fingerprint, sets) -> None:
    """Fill the cache of a pipeline's deterministic prefix for every sample, in parallel."""
    import numpy as np
    from tqdm import tqdm

    from ..cache import open_entry
    from ..cache.settings import CacheSettings
    from ..cache.store import entry_bytes
    from ..exec.cache_step import CacheStep
    from ..exec.contract import Task
    from ..exec.pool.errors import unpack_exception
    from ..exec.pool.process_pool import ProcessPool
    from ..balancer.autoscale import fixed_workers
    from ..pipeline import Pipeline
    from .options import parse_sets

    overrides = parse_sets(sets)
    if data:
        overrides["source.path"] = data
    p = Pipeline.from_yaml(pipeline_file, **overrides)
    base = p.cache or CacheSettings()
    settings = dataclasses.replace(base, dir=Path(cache_dir) if cache_dir else base.dir,
                                   compression=compression or base.compression,
                                   fingerprint=fingerprint or base.fingerprint)  # validates
    plan = p.plan("cpu")
    entry = open_entry(settings, p.source, p.stages, plan)
    if entry is None:
        raise click.ClickException("nothing to cache in this pipeline (see the warning above)")
    todo = np.flatnonzero((entry.part_of < 0) & ~np.isin(np.arange(entry.n), list(entry.quarantined)))
    step = CacheStep(entry, plan.cache_cut)
    stages = plan.sample_stages[:step.after]
    click.echo(f"cache entry {entry.dir}: {entry.cached} of {entry.n} samples cached, {len(todo)} to build")
    chunks = [todo[i:i + 64] for i in range(0, len(todo), 64)]

    def handler(task):
        from ..errors import DecodeError

        done = bad = 0
        for idx in task.indices.tolist():
            rec = p.source.read(idx)
            x = rec.payload
            try:
                for st in stages:
                    x = st.apply(x, None)
            except DecodeError as e:
                step.quarantine(idx, rec.key, e.reason)
                bad += 1
                continue
            step.store(idx, rec.key, rec.label, x)
            done += 1
        return done, bad

    t0 = time.perf_counter()
    nw = max(1, workers if workers is not None else fixed_workers(p.num_workers))
    pool = ProcessPool(handler, nw, on_exit=step.pause, on_idle=step.pause, name="feedgpu-cache")
    try:
        for i, c in enumerate(chunks):
            pool.submit(Task(0, i, indices=c))
        built = quarantined = 0
        with tqdm(total=len(todo), desc="caching", unit="img") as bar:
            for _ in chunks:
                _, seq, _, ok, payload = pool.get()
                if not ok:
                    raise unpack_exception(payload, f"while caching chunk {seq}")
                built += payload[0]
                quarantined += payload[1]
                bar.update(payload[0] + payload[1])
    finally:
        pool.close(grace_s=60.0)
    entry.refresh()
    click.echo(f"built {built} samples, quarantined {quarantined}, in {time.perf_counter() - t0:.1f} s; "
               f"entry holds {entry.cached}/{entry.n} ({_human(entry_bytes(entry.dir))})")


@cache.command("verify")
@click.argument("fingerprint", required=False)
@click.option("--cache-dir", type=click.Path(file_okay=False))
@click.option("--no-repair", is_flag=True, help="Only report; do not drop bad parts.")
def verify_cmd(fingerprint, cache_dir, no_repair) -> None:
    """Check every part's checksum and every row; bad parts are dropped (rebuilt on next use)."""
    from tqdm import tqdm

    from ..cache import entries, verify

    es = [e for e in entries(_root(cache_dir)) if fingerprint in (None, e["fingerprint"])]
    if not es:
        raise click.ClickException("no cache entries found")
    failed = False
    for e in tqdm(es, desc="verifying", unit="entry", disable=len(es) < 2):
        r = verify(Path(e["path"]), repair=not no_repair)
        status = "ok" if not r["bad_parts"] else f"{len(r['bad_parts'])} bad part(s)"
        click.echo(f"{e['fingerprint']}: {r['parts']} parts, {r['rows']} rows verified: {status}")
        for name, why in r["bad_parts"]:
            failed = True
            click.echo(f"  {name}: {why}" + ("" if no_repair else " (dropped)"))
        if r["stray_files"]:
            click.echo(f"  {len(r['stray_files'])} stray file(s) from interrupted writes"
                       + ("" if no_repair else " (removed)"))
    if failed:
        raise SystemExit(1)


@cache.command("info")
@click.option("--cache-dir", type=click.Path(file_okay=False))
@click.option("--index-dir", type=click.Path(file_okay=False), help=_INDEX_DIR_HELP)
@click.option("--json", "as_json", is_flag=True,
              help="Print the entries as JSON (a list; the saved folder indexes are not in it).")
def info_cmd(cache_dir, index_dir, as_json) -> None:
    """List cache entries (size, samples cached, quarantined, compression, last use) and the
    saved folder and tar shard indexes (count, bytes)."""
    from ..cache import entries
    from ..sources.folder_index import saved_indexes

    es = entries(_root(cache_dir))
    if as_json:
        click.echo(json.dumps(es, indent=2))
        return
    click.echo(f"cache root {_root(cache_dir)}: {len(es)} entr{'y' if len(es) == 1 else 'ies'}, "
               f"{_human(sum(e['bytes'] for e in es))}")
    for e in es:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_used"])) if e["last_used"] else "-"
        click.echo(f"  {e['fingerprint']}  {_human(e['bytes']):>10}  {e['rows']}/{e['samples']} rows  "
                   f"{e['quarantined']} quarantined  {e['compression']}  last used {used}")
    idx = saved_indexes(_index_dir(index_dir))
    click.echo(f"folder indexes {_index_dir(index_dir)}: {len(idx)} saved, "
               f"{_human(sum(p.stat().st_size for p in idx))}")
    tar_dir = _tar_index_dir()
    idx = saved_indexes(tar_dir)
    click.echo(f"tar shard indexes {tar_dir}: {len(idx)} saved, {_human(sum(p.stat().st_size for p in idx))}")


@cache.command("clear")
@click.argument("fingerprint", required=False)
@click.option("--cache-dir", type=click.Path(file_okay=False))
@click.option("--index-dir", type=click.Path(file_okay=False), help=_INDEX_DIR_HELP)
@click.option("--yes", is_flag=True, help="Do not ask.")
def clear_cmd(fingerprint, cache_dir, index_dir, yes) -> None:
    """Delete one entry (by fingerprint), or all of them and the saved folder and tar shard
    indexes (a source opened later indexes afresh)."""
    from ..cache import clear
    from ..sources.folder_index import clear_saved

    what = (f"entry {fingerprint}" if fingerprint else
            f"every entry under {_root(cache_dir)}, the saved folder indexes in {_index_dir(index_dir)} "
            f"and the saved tar shard indexes in {_tar_index_dir()}")
    if not yes:
        click.confirm(f"delete {what}?", abort=True)
    n, busy = clear(_root(cache_dir), fingerprint)
    msg = (f"deleted {n} entr{'y' if n == 1 else 'ies'}"
           + (f"; {busy} in use by a running loader, left alone" if busy else ""))
    if not fingerprint:
        k, size = clear_saved(_index_dir(index_dir))
        msg += f"; deleted {k} saved folder index{'' if k == 1 else 'es'} ({_human(size)})"
        k, size = clear_saved(_tar_index_dir())
        msg += f"; deleted {k} saved tar shard index{'' if k == 1 else 'es'} ({_human(size)})"
    click.echo(msg)


@click.command()
@click.argument("src", type=click.Path(exists=True))
@click.argument("out")
@click.option("--to", "fmt", type=click.Choice(["parquet", "tar"]), default="parquet", show_default=True)
@click.option("--per-file", type=int, default=1000, show_default=True, help="Samples per output file.")
@click.option("--storage-options", default=None, metavar="YAML",
              help="For a URL OUT: options of the store's fsspec filesystem, a YAML/JSON mapping "
                   "(credentials come the store's standard way).")
def convert(src, out, fmt, per_file, storage_options) -> None:
    """Turn an ImageFolder directory SRC (or tar shards) into Parquet files or tar shards in OUT.

    OUT must be new or empty; it appears only once everything is written and read back. Every
    record of SRC is written with its label, or listed as left out with the reason (records the
    source cannot index, such as empty files). OUT may be a folder URL (s3://bucket/train,
    gs://..., file://...): the dataset is built and read back in a local temporary folder, then
    uploaded (files, _classes.txt, then _index.json).

    Exit status: 0 when every record was converted, 1 when some were left out (listed), 2 on an
    error (nothing is written then; for a URL, an upload that failed part-way names the files).
    """
    import sys

    from ..remote.urls import is_url

    if is_url(out):
        _convert_to_url(src, out, fmt, per_file, storage_options)
        return

    from ..convert import folder_to_parquet, folder_to_tar, shards_to_parquet

    from ..errors import ConfigError

    from ..sources.extensions import PARQUET_EXTENSIONS, TAR_EXTENSIONS

    src_path = Path(src)
    names = [n.lower() for n in os.listdir(src_path)] if src_path.is_dir() else []
    is_shards = src_path.name.lower().endswith(TAR_EXTENSIONS) or any(n.endswith(TAR_EXTENSIONS) for n in names)
    if src_path.name.lower().endswith(PARQUET_EXTENSIONS) or \
            (not is_shards and any(n.endswith(PARQUET_EXTENSIONS) for n in names)):
        raise ConfigError(f"convert: {src} holds Parquet files; convert reads an ImageFolder directory or "
                          "tar shards (a Parquet source is read by the loader as it is)")
    if is_shards and fmt == "parquet":
        files = shards_to_parquet(src, out, rows_per_file=per_file, progress=True)
    elif is_shards:
        raise ConfigError(f"convert: {src} is already tar shards; give --to parquet")
    elif fmt == "parquet":
        files = folder_to_parquet(src, out, rows_per_file=per_file, progress=True)
    else:
        files = folder_to_tar(src, out, samples_per_shard=per_file, progress=True)
    click.echo(f"wrote {len(files)} {fmt} file(s) to {out}: {files.samples} samples, read back with their labels")
    if files.left_out:
        by_reason: dict = {}
        for key, reason in files.left_out:
            by_reason.setdefault(reason, []).append(key)
        click.echo(f"left out {len(files.left_out)} record(s) of the source:")
        for reason, keys in by_reason.items():
            click.echo(f"  {reason}: {len(keys)}")
            for k in keys[:20]:
                click.echo(f"    {k}")
            if len(keys) > 20:
                click.echo(f"    ... and {len(keys) - 20} more")
        sys.exit(1)


def _convert_to_url(src, url, fmt, per_file, storage_options) -> None:
    """``feedgpu convert SRC URL``: build in a temporary folder with the same checks, upload."""
    import shutil
    import tempfile

    import yaml

    from ..errors import ConfigError
    from ..remote.upload import upload_dir

    options = yaml.safe_load(storage_options) if storage_options else None
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"--storage-options: expected a mapping, got {storage_options!r}")
    from ..convert import URL_BUILD_PREFIX, remove_stale_url_builds

    remove_stale_url_builds()   # what converts killed before they finished left
    tmp = tempfile.mkdtemp(prefix=f"{URL_BUILD_PREFIX}{os.getpid()}-")
    try:
        local = Path(tmp) / "out"
        code = 0
        try:
            convert.callback(src, str(local), fmt, per_file, None)
        except SystemExit as e:   # 1: records left out (listed), still uploaded
            code = e.code
        from ..sources.tar.table import SUFFIX

        for table in local.glob(f"*{SUFFIX}"):   # a remote tar source reads its member table from _index.json
            table.unlink()
        written = upload_dir(local, url, options)
        click.echo(f"uploaded {len(written)} file(s) to {url} (built and checked in a temporary folder, "
                   "now removed)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if code:
        raise SystemExit(code)
