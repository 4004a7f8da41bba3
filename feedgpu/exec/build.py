"""What a :class:`~feedgpu.DataLoader` runs its batches with: the work object and the pool.

The work object holds what one batch needs (a pipeline's stages and shared-memory slots, DALI's
pipeline, a torch Dataset with its ``collate_fn``, a table pipeline); the pool runs its tasks
in worker processes (and with ``executor: ray`` on remote workers too).
"""
from __future__ import annotations

from .assemble import Assembler
from .cache_step import CacheStep
from .memory_budget import apply_budget
from .memory_watch import CopyOnReadWatch
from .pool.start import draw_base_seed, resolve_context
from .pool.process_pool import ProcessPool
from .work import DatasetWork, PipelineWork


def make_work(loader):
    """The work object of ``loader``'s current settings (buffers sized for its largest pool, the
    prefetch depth and the source's read cache sized by its memory budget, see
    :mod:`feedgpu.exec.memory_budget`)."""
    p, device, engine = loader.pipeline, loader._device, loader._engine
    if p is not None and engine.name != "dali":
        spec = p.plan(device).pool_spec
        apply_budget(loader, spec.shape, spec.dtype)
    else:
        apply_budget(loader)
    prefetch = loader._prefetch
    inflight = loader.num_workers * prefetch
    most = inflight
    auto = loader._autoscaler
    if auto is not None:  # buffers for the largest pool the balancer may choose
        c = auto.policy.config
        most = max(inflight, (c.max_workers + auto.max_remote) * c.max_prefetch)
    elif loader._executor.remote:
        inflight = most = (loader.num_workers + loader._remote_start) * prefetch
    if p is not None and engine.name == "dali":
        from .dali.engine import DaliWork

        plan = p.plan(device)
        dev_id = int(device.split(":")[1]) if device.startswith("cuda:") else 0
        return DaliWork(p.source, plan, loader.seed, loader._on_error, loader._batch_size,
                        device=engine.dali_device(device), threads=engine.threads or max(1, loader.num_workers),
                        device_id=dev_id, hw_decoder_load=engine.hw_decoder_load,
                        window_decode=engine.window_decode, in_dali_batch_stage=not plan.batch_on_device,
                        ahead=prefetch)
    if p is not None:
        plan = p.plan(device)
        cache = None
        if loader._cache_settings is not None:
            from ..cache import open_entry

            entry = open_entry(loader._cache_settings, p.source, p.stages, plan)
            cache = CacheStep(entry, plan.cache_cut) if entry is not None else None
        asm = Assembler(p.source, plan, loader.seed, loader._on_error, cache=cache)
        work = PipelineWork(asm, loader._batch_size, most, populate=inflight)
        if auto is not None:
            auto.buffer_bytes = work.slots.nbytes * (inflight + work.keep_views)
        return work
    if getattr(loader, "_torchvision", None) is not None:   # a torchvision dataset, compiled
        return loader._torchvision.make_work(loader)
    if hasattr(loader.dataset, "make_work"):  # a dataset that batches itself (feedgpu.tabular)
        return loader.dataset.make_work(loader.seed)
    if getattr(loader, "_memory_watch", None) is None:
        forked = resolve_context(loader.multiprocessing_context).get_start_method() == "fork"
        loader._memory_watch = CopyOnReadWatch(loader.dataset, forked=forked)
    # torch's auto-collation: batches whenever there is a batch sampler (batch_size=None: none)
    return DatasetWork(loader.dataset, loader._collate, loader.seed, batched=loader.batch_sampler is not None)


def make_pool(loader, work):
    """A :class:`ProcessPool` for ``work``, or with ``executor: ray`` a
    :class:`~feedgpu.exec.remote.mixed_pool.MixedPool` (local workers, if any, and remote ones)."""
    local = None
    if loader.num_workers > 0:
        # with a cache, workers get time to write their last rows when they stop
        local = ProcessPool(work.handle, loader.num_workers, loader.worker_init_fn, on_exit=work.on_exit,
                            on_idle=work.on_idle,
                            grace_s=10.0 if loader._cache_settings is not None else 1.0,
                            describe=work.describe, on_start=work.on_start,
                            context=loader.multiprocessing_context, dataset=loader.dataset,
                            base_seed=draw_base_seed(loader.generator))  # per pool start (torch: per iterator)
    if not loader._executor.remote:
        return local
    from .remote.mixed_pool import MixedPool

    auto = loader._autoscaler
    remote = auto.remote if auto is not None else loader._remote_start
    try:
        return MixedPool(local, work.remote_handler(), work.land, remote, loader._executor)
    except BaseException:
        if local is not None:
            local.close()
        raise
