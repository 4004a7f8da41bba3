"""``feedgpu scan DATA``: find bad samples before training."""
from __future__ import annotations

import json
import sys

import click


@click.command("scan")
@click.argument("data")
@click.option("--format", "fmt", type=click.Choice(["folder", "tar", "parquet"]), default=None,
              help="Source format (default: from DATA: .tar shards, .parquet files, else a folder).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a key of a pipeline file DATA (dotted path), e.g. source.path=/data.")
@click.option("--workers", type=int, default=None, help="Worker processes (default: CPU count; 0: none).")
@click.option("--max-pixels", type=int, default=None,
              help="Pixel limit (default: the pipeline's decode stage, else 89,478,485).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Write the full report as JSON to this file ('-': stdout, instead of the text).")
@click.option("--quarantine", type=click.Path(dir_okay=False), default=None,
              help="Write the bad samples as a quarantine file (JSON).")
@click.option("--to-cache", is_flag=True,
              help="Add the bad samples to the pipeline's cache entry (DATA must be a pipeline file): "
                   "the loader then skips them without reading them.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="With --to-cache: the cache directory (default: the pipeline's cache).")
@click.option("--show", type=int, default=20, show_default=True, help="Sample names listed per reason.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: when stderr is a terminal).")
def scan(data, fmt, sets, workers, max_pixels, json_out, quarantine, to_cache, cache_dir, show, progress):
    """Read and decode every sample of DATA and report the bad ones by reason.

    DATA is a folder (ImageFolder layout), a directory of .tar shards or .parquet files, one such
    file, a URL of such files or their _index.json (s3://, gs://, http(s)://: read through the
    shard cache in the user cache directory), or a pipeline YAML file (its source and decode stage are used). Each bad sample is
    named as the loader names it: a path, shard.tar:member, or file.parquet#row.

    Exit status: 0 when every sample decodes, 1 when bad samples were found (records the source
    left out while indexing count: missing labels, truncated shards ...), 2 on an error (bad
    arguments, a dataset that cannot be opened); errors are one line on stderr, never a traceback.
    """
    import os

    from ..remote.urls import is_url
    from ..scan import open_for_scan, quarantine_in_cache, scan_source
    from .options import parse_sets

    if not is_url(data) and not os.path.exists(data):
        raise click.BadParameter(f"Path {data!r} does not exist.", param_hint="'DATA'")

    overrides = parse_sets(sets)
    try:
        source, decode, pipeline = open_for_scan(data, fmt, overrides, max_pixels)
    except OSError as e:   # feedgpu's own errors exit 2 in the command group
        click.echo(f"error: cannot open {data}: {e}", err=True)
        sys.exit(2)
    if to_cache and pipeline is None:
        raise click.UsageError("--to-cache needs DATA to be a pipeline file (the cache key depends on its stages)")
    report = scan_source(source, decode, workers=workers, progress=sys.stderr.isatty() if progress is None else progress)
    if json_out == "-":
        click.echo(json.dumps(report.as_dict(), indent=1))
    else:
        click.echo(report.text(show))
        if json_out:
            with open(json_out, "w", encoding="utf-8") as f:
                json.dump(report.as_dict(), f, indent=1)
            click.echo(f"report: {json_out}")
    if quarantine:
        click.echo(f"quarantine list: {report.write_quarantine(quarantine)}", err=json_out == "-")
    if to_cache:
        entry = quarantine_in_cache(report, pipeline, cache_dir)
        click.echo(f"quarantined {sum(b.index >= 0 for b in report.bad)} samples in cache entry {entry}",
                   err=json_out == "-")
    sys.exit(1 if report.bad else 0)
