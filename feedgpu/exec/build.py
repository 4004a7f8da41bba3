"""What a :class:`~feedgpu.DataLoader` runs a pipeline's batches with: the work object and the pool.

The work object holds what one batch needs (a pipeline's stages and shared-memory slots, or
DALI's pipeline); the pool runs a work's tasks in worker processes (and with ``executor: ray`` on
remote workers too). Both are made from values the loader resolved (its options, its live worker
count and prefetch depth), never from the loader itself.
"""
from __future__ import annotations

from .assemble import Assembler
from .cache_step import CacheStep
from .pool.start import draw_base_seed
from .pool.process_pool import ProcessPool
from .work import PipelineWork


def make_work(pipeline, *, device: str, engine, cache, seed: int, on_error: str, batch_size: int, threads: int,
              prefetch: int, inflight: int, most: int):
    """The work object of ``pipeline`` on ``engine`` (:class:`~feedgpu.exec.engines.EngineSettings`)
    delivering to ``device``: DALI's (``threads`` CPU threads unless the engine fixes them,
    ``prefetch`` batches ahead), else a :class:`PipelineWork` with shared-memory slots for
    ``most`` batches in flight (``inflight`` of them touched now) and the cache step when
    ``cache`` (:class:`~feedgpu.cache.CacheSettings`) is set."""
    plan = pipeline.plan(device)
    if engine.name == "dali":
        from .dali.engine import DaliWork

        dev_id = int(device.split(":")[1]) if device.startswith("cuda:") else 0
        return DaliWork(pipeline.source, plan, seed, on_error, batch_size, device=engine.dali_device(device),
                        threads=engine.threads or max(1, threads), device_id=dev_id,
                        hw_decoder_load=engine.hw_decoder_load, window_decode=engine.window_decode,
                        in_dali_batch_stage=not plan.batch_on_device, ahead=prefetch)
    step = None
    if cache is not None:
        from ..cache import open_entry

        entry = open_entry(cache, pipeline.source, pipeline.stages, plan)
        step = CacheStep(entry, plan.cache_cut) if entry is not None else None
    asm = Assembler(pipeline.source, plan, seed, on_error, cache=step)
    return PipelineWork(asm, batch_size, most, populate=inflight)


def make_pool(work, *, workers: int, worker_init_fn, context, dataset, generator, cached: bool, executor,
              remote: int):
    """A :class:`ProcessPool` of ``workers`` processes for ``work`` (None without), or with
    ``executor: ray`` (:class:`~feedgpu.exec.executors.ExecutorSettings`) a
    :class:`~feedgpu.exec.remote.mixed_pool.MixedPool` of those and ``remote`` remote workers. ``cached``:
    a cache is written (workers get time to write their last rows when they stop)."""
    local = None
    if workers > 0:
        local = ProcessPool(work.handle, workers, worker_init_fn, on_exit=work.on_exit, on_idle=work.on_idle,
                            grace_s=10.0 if cached else 1.0, describe=work.describe, on_start=work.on_start,
                            context=context, dataset=dataset,
                            base_seed=draw_base_seed(generator))  # per pool start (torch: per iterator)
    if not executor.remote:
        return local
    from .remote.mixed_pool import MixedPool

    try:
        return MixedPool(local, work.remote_handler(), work.land, remote, executor)
    except BaseException:
        if local is not None:
            local.close()
        raise
