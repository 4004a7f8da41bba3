"""``feedgpu index PATH...``: build the indexes a source would build on its first open, ahead of training."""
from __future__ import annotations

import json
import sys

import click


@click.command("index")
@click.argument("paths", nargs=-1, required=True)
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Tar shards indexed at once (default: as feedgpu convert writes tables, up to 2).")
@click.option("--force", is_flag=True, help="Rewrite tables and indexes that are up to date.")
@click.option("--index-dir", type=click.Path(file_okay=False), default=None,
              help="Folders: where the saved index goes, as source.index_dir (default: "
                   "<feedgpu cache dir>/folder-index).")
@click.option("--stat-files/--no-stat-files", default=None,
              help="Folders: as source.stat_files (default: auto, as the source's default; the saved "
                   "index is kept per setting).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text.")
def index(paths, threads, force, index_dir, stat_files, as_json) -> None:
    """Build indexes ahead of training, for data feedgpu did not write.

    Tar shards (a shard, a directory of *.tar, a glob): write the member table
    <shard>.feedgpu-index beside each shard that has no valid one, as `feedgpu convert --to
    tar` does, so a new machine or cache dir opens the shards without reading every header.
    An ImageFolder directory: save its index where a folder source (with the same
    --index-dir and --stat-files as the pipeline's source section) looks for it. Parquet
    files need no index (a Parquet source reads their footers): said so, exit 0.

    A shard that cannot be read or is damaged (truncated, not a tar, no permission) gets no
    table and is named with its reason; the others are indexed. Exit status: 0 when all is
    indexed or up to date, 2 when something failed (named on stderr) or on a bad argument.
    """
    from ..errors import SourceError
    from ..sources.prebuild import index_folder, index_shards, path_kind

    stat_files = "auto" if stat_files is None else stat_files
    kinds: dict[str, list] = {"tar": [], "folder": [], "parquet": []}
    for p in paths:
        try:
            kinds[path_kind(p)].append(p)
        except SourceError as e:
            raise click.BadParameter(str(e), param_hint="'PATH'") from None
    out: dict = {}
    failed: list = []
    lines: list[str] = []
    if kinds["parquet"]:
        out["parquet"] = list(kinds["parquet"])
        lines += [f"parquet {p}: needs no index (a Parquet source reads the files' footers)" for p in kinds["parquet"]]
    if kinds["tar"]:
        try:
            tar = index_shards(kinds["tar"], threads=threads, force=force)
        except SourceError as e:
            failed.append((", ".join(kinds["tar"]), str(e)))
        else:
            out["tar"] = tar.as_dict()
            lines.append(tar.line())
            failed += tar.failed
    for root in kinds["folder"]:
        try:
            rep = index_folder(root, index_dir=index_dir, stat_files=stat_files, force=force)
        except SourceError as e:
            failed.append((root, str(e)))
            continue
        out.setdefault("folders", []).append(rep.as_dict())
        lines.append(rep.line())
    out["failed"] = [list(f) for f in failed]
    if as_json:
        click.echo(json.dumps(out, indent=1))
    else:
        for line in lines:
            click.echo(line)
    for what, why in failed:
        click.echo(f"failed: {what}: {why}", err=True)
    sys.exit(2 if failed else 0)
