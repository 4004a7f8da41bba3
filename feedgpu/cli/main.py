"""The ``feedgpu`` command line.

Help and listings answer without importing torch or the loader: each command imports what it
needs when it runs, and the commands of other modules (``bench``, ``cache``, ``convert``,
``index``, ``scan``) are imported only when named or when ``--help`` lists them (those modules
import nothing heavy at their top).
"""
from __future__ import annotations

import importlib
import json
import sys

import click

from ..errors import FeedgpuError
from .options import parse_sets


#: command name -> "module:attribute" of the commands defined outside this module
_LAZY_COMMANDS = {"bench": "feedgpu.cli.bench:bench", "cache": "feedgpu.cli.cache:cache",
                  "convert": "feedgpu.cli.cache:convert", "index": "feedgpu.cli.index:index",
                  "scan": "feedgpu.cli.scan:scan"}


class _Group(click.Group):
    """Reports feedgpu's own errors as one clean line and exit code 2, not a traceback; imports
    the module of a command in :data:`_LAZY_COMMANDS` only when that command is looked up."""

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(_LAZY_COMMANDS))

    def get_command(self, ctx, name):
        if name not in self.commands and name in _LAZY_COMMANDS:
            module, attr = _LAZY_COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FeedgpuError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="feedgpu")
def main() -> None:
    """feedgpu: feed GPUs from PyTorch without CPU data stalls."""


@main.group()
def pipeline() -> None:
    """Check and describe pipeline files."""


@pipeline.command("validate")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a key (dotted path).")
def validate_cmd(file: str, sets: tuple[str, ...]) -> None:
    """Check FILE against the pipeline schema; list every problem with its key path."""
    from ..pipeline import Pipeline, device_label

    if _is_table(file):
        from ..tabular import TablePipeline

        t = TablePipeline.from_yaml(file, **parse_sets(sets))
        click.echo(f"{file}: ok (table: {len(t.stages)} stages, {len(t.dense_names())} dense features, "
                   f"{len(t.cardinalities())} categorical, engine {t.engine})")
        return
    p = Pipeline.from_yaml(file, **parse_sets(sets))
    click.echo(f"{file}: ok ({p.name}: {len(p.stages)} stages, batch {p.batch_size}, "
               f"{p.num_workers} workers, output {p.output_dtype} on {device_label(p.device)})")


@pipeline.command("explain")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--data", type=click.Path(exists=True), help="Dataset path (sets source.path).")
@click.option("--device", default=None, help="Plan for this output device (cpu, cuda, auto).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a key (dotted path).")
def explain_cmd(file: str, data: str | None, device: str | None, sets: tuple[str, ...]) -> None:
    """Show FILE's stages, where each runs, and the output shape and dtype."""
    from ..pipeline import Pipeline

    overrides = parse_sets(sets)
    if data:
        overrides["source.path"] = data
    if _is_table(file):  # a table pipeline: fitted (or its fit file loaded) to show cardinalities
        from ..tabular import TablePipeline

        click.echo(TablePipeline.from_yaml(file, **overrides).explain())
        return
    p = Pipeline.from_yaml(file, **overrides)
    click.echo(p.explain(device))


def _is_table(file: str) -> bool:
    from ..config import load_yaml

    return load_yaml(file).get("kind") == "table"


@main.command("stages")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: a list with one object per stage.")
def stages_cmd(as_json: bool) -> None:
    """List the stages a pipeline file may use (built-in and installed through the
    'feedgpu.stages' entry point), with their parameters, defaults and allowed values."""
    from ..stages.params import describe_stage
    from ..stages.registry import BUILTIN, stage_classes

    found = [dict(describe_stage(cls), builtin=BUILTIN.get(name) is cls) for name, cls in stage_classes().items()]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    for d in found:
        det = {True: "deterministic", False: "random, seeded", None: "random or not (see its parameters)"}[d["deterministic"]]
        engines = "python, dali" if d["dali"] else "python"
        click.echo(f"{d['name']}  ({d['kind']} stage, {det}, engines: {engines}"
                   f"{'' if d['builtin'] else ', plugin ' + d['class']})")
        if d["summary"]:
            click.echo(f"    {d['summary']}")
        for prm in d["params"]:
            default = "required" if prm["required"] else f"default {prm['default']!r}"
            click.echo(f"    {prm['name']}: {prm['type']}, {default}")
        if d["set_from_output"]:
            click.echo(f"    ({', '.join(d['set_from_output'])}: from the output section)")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def doctor(as_json: bool) -> None:
    """Report the PIL build (Pillow-SIMD? AVX2?), torch, CUDA, DALI and Ray."""
    import importlib.util

    import torch

    from ..imaging import pil_build

    try:
        dali = importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no "nvidia" namespace package at all
        dali = False
    from importlib.metadata import PackageNotFoundError, version

    try:
        ray = version("ray")   # the version only: importing ray takes seconds
    except PackageNotFoundError:
        ray = None
    info = {"pil": pil_build(), "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "dali": dali, "ray": ray}
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    pil = info["pil"]
    click.echo(f"PIL:   {'Pillow-SIMD' if pil['simd'] else 'Pillow'} {pil['version']}, "
               f"AVX2: {pil['avx2']}, libjpeg-turbo: {pil['libjpeg_turbo']}, WebP: {pil['webp']}")
    if not pil["webp"]:
        click.echo("       this PIL build cannot decode WebP (WebP files are skipped): build Pillow-SIMD with "
                   "libwebp's headers (scripts/setup.sh installs libwebp-dev)")
    if not pil["simd"]:
        click.echo("       stock Pillow is active: reinstall pillow-simd (scripts/setup.sh) for ~5x faster resize")
    click.echo(f"torch: {info['torch']}, CUDA available: {info['cuda_available']}")
    click.echo(f"DALI:  {'installed' if info['dali'] else 'not installed (pip install feedgpu[dali])'}")
    click.echo(f"Ray:   {info['ray'] or 'not installed (pip install feedgpu[ray]) for executor: ray'}")


if __name__ == "__main__":  # python -m feedgpu.cli.main
    main()
