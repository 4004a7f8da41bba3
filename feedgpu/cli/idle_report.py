"""``feedgpu bench --model / --consumer-rate``: run :func:`feedgpu.idle.analyze` and report it."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from ..errors import ConfigError


def idle_bench(p, file: str, path: str, model: str | None, consumer_rate: float | None, duration: float,
               workers: int | None, batch_size: int | None, device: str, json_path: str | None,
               plot_path: str | None, compare_engines: bool = False) -> None:
    from .. import idle
    from ..loader import DataLoader
    from .bench import machine_info

    if model and consumer_rate:
        raise click.UsageError("give --model or --consumer-rate, not both")
    try:
        if model:
            m, label = idle.load_model(model)
            consumer = idle.ModelConsumer(m, device if device != "cpu" else "cpu", f"model {label} on {device}")
        else:
            consumer = idle.RateConsumer(consumer_rate)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    nw = "auto" if workers is None else workers
    bs = batch_size or p.batch_size

    def make_loader(**over):
        return DataLoader(p, batch_size=bs, num_workers=nw, device=device, **over)

    click.echo(f"feedgpu bench: why is the GPU idle? {consumer.label}; {p.name} on {path}; "
               f"3 phases of {duration:.0f} s", err=True)
    t0 = time.perf_counter()
    report = idle.analyze(make_loader, consumer, duration, on_gpu=device != "cpu", compare_engines=compare_engines)
    report.update(pipeline=file, data=path, batch_size=bs, num_workers=nw, device=device, machine=machine_info(),
                  created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), format="feedgpu.idle/1",
                  total_seconds=round(time.perf_counter() - t0, 1))
    _print(report)
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        if idle.plot(report, plot_path):
            click.echo(f"wrote {plot_path}", err=True)
        else:
            click.echo("no plot written (see the warning above)", err=True)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
        click.echo(f"wrote {json_path}", err=True)


def _print(r: dict) -> None:
    m, a, b = r["model_alone"], r["loader_alone"], r["together"]
    click.echo(f"consumer:      {r['consumer']}")
    click.echo(f"model alone:   {1e3 * m['seconds_per_step']:.1f} ms/step = {m['samples_per_s']:,.0f} samples/s "
               f"(batch already on the device)")
    click.echo(f"loader alone:  {a['samples_per_s']:,.0f} samples/s ({a['workers']} workers at the end)")
    click.echo(f"both:          {b['samples_per_s']:,.0f} samples/s, waited {b['median_wait_ms']:.1f} ms "
               f"per batch (median)")
    click.echo(f"GPU idle:      {100 * r['gpu_idle_fraction']:.1f} % (reads {100 * r['wait_split']['read']:.1f} %, "
               f"preprocessing {100 * r['wait_split']['preprocess']:.1f} %)")
    if r.get("network_wait_fraction"):
        click.echo(f"network:       the loader waited for shard downloads {100 * r['network_wait_fraction']:.1f} % "
                   "of the time (waiting for the network)")
    costs = r["stage_costs"]["ms_per_sample"]
    if costs:
        click.echo("stage costs:   " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()) + " ms/sample (workers)")
    bal = r["balancer"]
    if bal["timeline"]:
        click.echo(f"balancer:      {len(bal['timeline'])} windows, ended at {bal['final_workers']} workers, "
                   f"prefetch {bal['final_prefetch']}")
        for d in bal["decisions"][-8:]:
            click.echo(f"  t={d['t'] - bal['timeline'][0]['t']:+.0f}s {d['kind']} -> {d['workers']} workers: "
                       f"{d['reason']}")
    pl = r.get("placement")
    if pl:
        click.echo("placement:     " + ", ".join(f"{k} {v['samples_per_s']:,.0f}/s on {v['cpu_cores']:.1f} cores"
                                                 for k, v in pl["measured"].items()) + f" -> {pl['choice']}")
    click.echo("")
    click.echo(r["recommendation"])
