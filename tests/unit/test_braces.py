"""Brace patterns in shard paths and URLs (``train-{000..002}.tar``), as WebDataset and the
shell write them: each path named, in the pattern's order; a named shard that is missing is an
error, not a shard left out."""
from __future__ import annotations

import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from feedgpu.errors import SourceError
from feedgpu.remote.urls import expand_urls
from feedgpu.sources.base import braces, expand_paths
from feedgpu.sources.parquet import ParquetSource
from feedgpu.sources.tar import TarShardSource
from test_tar_index import pairs, write_tar


def test_a_brace_pattern_names_each_shard_in_its_order(tmp_path):
    for k in range(4):
        write_tar(tmp_path / f"train-{k:03d}.tar", pairs(3, prefix=f"k{k}_"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = TarShardSource(str(tmp_path / "train-{002..000}.tar"), index_dir=False)
    assert [s.rsplit("/", 1)[1] for s in src.shards] == ["train-002.tar", "train-001.tar", "train-000.tar"]
    assert len(src) == 9 and src.members[0].startswith("k2_")
    assert expand_paths(str(tmp_path / "train-{000,003}.tar"), ".tar") == [
        str(tmp_path / "train-000.tar"), str(tmp_path / "train-003.tar")]
    # a pattern whose items are globs or folders: each expanded as a spec of its own
    (tmp_path / "val").mkdir()
    write_tar(tmp_path / "val" / "v.tar", pairs(2))
    assert expand_paths(str(tmp_path / "{train-00[01].tar,val}"), ".tar") == [
        str(tmp_path / "train-000.tar"), str(tmp_path / "train-001.tar"), str(tmp_path / "val" / "v.tar")]


def test_a_shard_the_pattern_names_but_is_missing_is_an_error(tmp_path):
    for k in range(2):
        write_tar(tmp_path / f"s-{k}.tar", pairs(2))
    with pytest.raises(SourceError, match="1 of the 3 file.* names do not exist: .*s-2.tar"):
        TarShardSource(str(tmp_path / "s-{0..2}.tar"), index_dir=False)


def test_a_path_with_braces_in_its_name_is_itself(tmp_path):
    odd = tmp_path / "x-{1..2}.tar"
    write_tar(odd, pairs(2))
    assert braces(str(odd)) == [str(odd)]
    assert expand_paths(str(odd), ".tar") == [str(odd)]
    assert braces(str(tmp_path / "plain.tar")) == [str(tmp_path / "plain.tar")]


def test_parquet_files_and_urls_take_patterns_too(tmp_path):
    for k in range(3):
        pq.write_table(pa.table({"image": [b"\xff\xd8" + bytes([k])], "label": [k]}), tmp_path / f"p-{k}.parquet")
    src = ParquetSource(str(tmp_path / "p-{0..2}.parquet"))
    assert len(src) == 3 and src.labels.tolist() == [0, 1, 2]
    # over HTTP, which cannot list: a pattern names each URL, none is fetched to expand it
    assert expand_urls("http://127.0.0.1:9/d/train-{00..02}.tar", ".tar") == [
        (f"http://127.0.0.1:9/d/train-{k:02d}.tar", None) for k in range(3)]
