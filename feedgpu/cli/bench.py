"""``feedgpu bench``: the command line of :mod:`feedgpu.bench` (options in, text out).

Without ``--model``/``--consumer-rate`` it compares loaders side by side
(:func:`feedgpu.bench.runner.compare`), with one of them it says why the GPU is idle
(:func:`feedgpu.bench.runner.why_idle`).
"""
from __future__ import annotations

import time
from pathlib import Path

import click

from ..bench.subjects import ENGINE_KINDS
from .options import parse_sets


@click.command()
@click.option("--pipeline", "pipeline_file", type=click.Path(exists=True, dir_okay=False),
              help="Pipeline file (default: the packaged imagenet_train.yaml).")
@click.option("--data", type=click.Path(exists=True), help="Dataset path (sets source.path).")
@click.option("--images", default=2000, show_default=True, type=click.IntRange(1),
              help="Images in the default sample dataset (when no data is given).")
@click.option("--workers", type=click.IntRange(0),
              help="Workers for both loaders (default: the pipeline's count; for 'auto', one per core, as the "
                   "loaders are the only work; with --model/--consumer-rate, feedgpu's balancer decides).")
@click.option("--batch-size", type=click.IntRange(1), help="Batch size (default: the pipeline's).")
@click.option("--batches", type=click.IntRange(1),
              help="Timed batches per run, exactly (default: the rest of one epoch after the warm-up, rounded "
                   "down to a multiple of the workers, and more until --seconds have passed; more spans epochs).")
@click.option("--seconds", "min_seconds", default=10.0, show_default=True, type=click.FloatRange(min=0),
              help="Without --batches: time each run for at least this long (0: the rest of one epoch only).")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1),
              help="Runs per loader, alternating the loaders; medians are reported.")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(0),
              help="Batches per run left out of the timing (worker start-up, pipeline fill).")
@click.option("--engine", "engines", multiple=True, type=click.Choice(list(ENGINE_KINDS)),
              help="Loader to measure, repeatable: python (feedgpu's process pool), dali-cpu, dali-gpu "
                   "(feedgpu's DALI engine; DALI threads = --workers), torch (torch's DataLoader with "
                   "torchvision-style transforms on the same PIL build as feedgpu: Pillow-SIMD where installed). "
                   "Default: the pipeline's engine and torch.")
@click.option("--no-baseline", is_flag=True, help="Leave out the torch baseline.")
@click.option("--device", default="cpu", show_default=True, help="Where batches are delivered (cpu, cuda, cuda:N).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), help="Write results as JSON.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a pipeline key (dotted path).")
@click.option("--model", help="Why is my GPU idle: train this model on the batches (resnet18, resnet50 or "
                              "module:callable returning a torch.nn.Module).")
@click.option("--consumer-rate", type=click.FloatRange(min=0, min_open=True),
              help="Why is my GPU idle, without a GPU: a synthetic consumer taking this many samples/s.")
@click.option("--duration", default=20.0, show_default=True, type=click.FloatRange(min=1),
              help="With --model/--consumer-rate: timed seconds of each phase (model alone, loader alone, both); "
                   "with the balancer (no --workers) the loader phases first run half as long untimed, to settle.")
@click.option("--compare-engines", is_flag=True,
              help="With --model/--consumer-rate: also measure DALI's engines alone and say where the stages "
                   "should run.")
@click.option("--dataset", "dataset_ref", metavar="MODULE:FACTORY",
              help="Your own Dataset: a function returning it (e.g. train:make_dataset); measures torch's "
                   "DataLoader against feedgpu.DataLoader on it and shows what feedgpu compiled.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True),
              help="With --model/--consumer-rate: write throughput, idle share and workers over time as PNG.")
def bench(pipeline_file, data, images, workers, batch_size, batches, min_seconds, rounds, warmup, engines, no_baseline,
          device, json_path, sets, model, consumer_rate, duration, compare_engines, plot_path,
          dataset_ref) -> None:
    """Measure feedgpu against torch's DataLoader on the same data, transforms and PIL build.

    The torch baseline is ``torch.utils.data.DataLoader`` with torchvision-style transforms,
    decoding and resizing with the PIL this environment has (Pillow-SIMD after
    scripts/setup.sh; the ``machine:`` line names it), so the speed-up is feedgpu's own, not
    Pillow-SIMD's.

    ``--engine`` (repeatable) compares feedgpu's engines (python, dali-cpu, dali-gpu) and the
    torch baseline side by side, in the same alternating rounds.

    With no argument, builds once (in the user's cache directory) an ImageNet-like sample from
    photographs shipped with feedgpu and runs imagenet_train.yaml on it. Prints, for each
    loader, samples/s and ms per batch (both from the same timed window), CPU use and the
    memory each worker holds alone (USS), and the speed-up.

    With ``--model`` or ``--consumer-rate``, answers "why is my GPU idle" instead: it times the
    model alone, the loader alone (``num_workers`` auto unless ``--workers``) and both together,
    and reports the GPU idle share, its causes, the balancer's choices and a recommendation
    (see :mod:`feedgpu.bench.idle`).
    """
    from ..bench import report, runner
    from ..errors import BenchRunError, BenchUsageError

    t0 = time.perf_counter()
    note = lambda line: click.echo(line, err=True)  # noqa: E731
    if dataset_ref:
        return _dataset(dataset_ref, workers, batch_size, batches, rounds, warmup, json_path, note)
    try:
        device = runner.check_device(device)
        p, file, path = runner.load_pipeline(pipeline_file, data, parse_sets(sets), device, images)
        if model or consumer_rate:
            doc = runner.why_idle(p, file, path, model=model, consumer_rate=consumer_rate, duration=duration,
                                  workers=workers, batch_size=batch_size, device=device,
                                  compare_engines=compare_engines, note=note)
        else:
            doc = runner.compare(p, file, path, workers=workers, batch_size=batch_size, batches=batches,
                                 min_seconds=0.0 if batches else min_seconds,
                                 rounds=rounds, warmup=warmup, engines=engines, no_baseline=no_baseline,
                                 device=device, sets=sets, note=note)
    except BenchUsageError as e:
        raise click.UsageError(str(e)) from None
    except BenchRunError as e:
        raise click.ClickException(str(e)) from None
    if model or consumer_rate:
        click.echo("\n".join(report.idle_lines(doc)))
        if plot_path:
            from ..bench.idle import plot

            Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
            note(f"wrote {plot_path}" if plot(doc, plot_path) else "no plot written (see the warning above)")
    else:
        doc["total_seconds"] = round(time.perf_counter() - t0, 1)
        click.echo("\n".join(report.comparison_lines(doc)))
        for line in report.comparison_warnings(doc):
            note(line)
        note(f"({doc['total_seconds']:.0f} s in all)")
    if json_path:
        report.write_json(doc, json_path)
        note(f"wrote {json_path}")


def _dataset(ref, workers, batch_size, batches, rounds, warmup, json_path, note) -> None:
    """``--dataset``: :func:`feedgpu.bench.dataset.compare_dataset`."""
    from ..bench import report
    from ..bench.dataset import compare_dataset, dataset_lines
    from ..errors import ConfigError

    try:
        doc = compare_dataset(ref, workers=2 if workers is None else workers, batch_size=batch_size or 64,
                              batches=batches or 10, rounds=rounds, warmup=max(1, warmup), note=note)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    click.echo("\n".join(dataset_lines(doc)))
    if json_path:
        report.write_json(doc, json_path)
        note(f"wrote {json_path}")
