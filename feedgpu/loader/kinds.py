"""The kinds of map-style dataset a :class:`feedgpu.DataLoader` runs, over :class:`MapBackend`:

* :class:`PipelineBackend`: a feedgpu :class:`~feedgpu.Pipeline` (its stages in shared-memory
  batches, or DALI), with spares for skipped samples and, on CUDA, the device prefetch;
* :class:`TorchvisionDaliBackend`: the pipeline :mod:`feedgpu.torchvision` made for DALI from a
  torchvision dataset (``engine="dali"``), refused when the dataset's recipe changed since;
* :class:`DatasetBackend`: a map-style torch Dataset (``dataset[i]`` and ``collate_fn`` in the
  workers, as torch), or a dataset that assembles its own batches (``make_work``: table pipelines);
* :class:`TorchvisionDatasetBackend`: a torchvision dataset whose transforms
  :mod:`feedgpu.torchvision` compiled, followed as torch's loader reads it.
"""
from __future__ import annotations

import logging

from ..exec.build import make_work
from ..exec.memory_watch import CopyOnReadWatch
from ..exec.pool.start import resolve_context
from ..exec.work import DatasetWork
from ..torchvision import TorchvisionBackend, backend_for
from ..torchvision.dali import recipe_key, refuse_changed_recipe
from ..torchvision.slots import slot_work
from ..torchvision.work import TorchvisionWork
from .mapped import MapBackend

__all__ = ["DatasetBackend", "PipelineBackend", "TorchvisionDaliBackend", "TorchvisionDatasetBackend"]

log = logging.getLogger("feedgpu.torchvision")


class PipelineBackend(MapBackend):
    """A feedgpu Pipeline's batches (see :class:`MapBackend` for the arguments)."""

    reports = True

    def __init__(self, dataset, options, given: dict):
        super().__init__(dataset, options, given)
        # samples the source left out while indexing, by reason (after the ranks' check)
        self.metrics.add_index_skips(self.pipeline.source)
        o = options
        dali_gpu = o.engine.name == "dali" and o.engine.dali_device(o.device) == "gpu"
        self.deferred_commit = o.device != "cpu" and not dali_gpu   # the CUDA prefetcher commits

    def num_samples(self, optional: bool = False) -> int:
        return len(self.pipeline.source)

    def identity(self) -> str:
        return self.pipeline.source.order_identity()

    def build_work(self):
        o, p = self.options, self.pipeline
        if o.engine.name != "dali":
            spec = p.plan(o.device).pool_spec
            plan = self.plan_budget(spec.shape, spec.dtype)
        else:
            plan = self.plan_budget()
        p.source.fit_memory(plan.cache_bytes)
        self.apply_budget(plan)
        inflight = most = self.num_workers * self.prefetch
        auto = self.autoscaler
        if auto is not None:  # buffers for the largest pool the balancer may choose
            c = auto.policy.config
            most = max(inflight, (c.max_workers + auto.max_remote) * c.max_prefetch)
        elif o.executor.remote:
            inflight = most = (self.num_workers + o.remote_start) * self.prefetch
        work = make_work(p, device=o.device, engine=o.engine, cache=o.cache, seed=self.seed,
                         on_error=o.settings.on_error, batch_size=self.batch_size, threads=self.num_workers,
                         prefetch=self.prefetch, inflight=inflight, most=most)
        if auto is not None and o.engine.name != "dali":
            auto.buffer_bytes = work.slots.nbytes * (inflight + work.keep_views)
        return work

    def wrap(self, it):
        if not self.deferred_commit:
            return it
        from .prefetch import CudaPrefetcher

        plan = self.pipeline.plan(self.options.device)
        return CudaPrefetcher(it, self.options.device, plan.batch_stage if plan.batch_on_device else None,
                              depth=self.prefetch)

    def explain(self) -> str:
        return self.pipeline.explain(self.options.device)


class TorchvisionDaliBackend(PipelineBackend):
    """The DALI pipeline ``pipe`` made from a torchvision dataset (``origin``), run as
    :class:`PipelineBackend` runs a pipeline. The loader shows ``origin`` as its ``dataset``, as
    torch's does (a loader made again from its attributes compiles the dataset as it is then);
    each iteration first checks that ``origin``'s recipe is the one the pipeline was made from
    (:func:`~feedgpu.torchvision.dali.refuse_changed_recipe`)."""

    def __init__(self, pipe, options, given: dict, origin):
        super().__init__(pipe, options, given)
        self.dataset, self.origin_key = origin, recipe_key(origin)

    def begin(self) -> None:
        refuse_changed_recipe(self.dataset, self.origin_key)


class DatasetBackend(MapBackend):
    """A map-style torch Dataset's batches, as torch's loader makes them (see :class:`MapBackend`)."""

    #: why the dataset was not compiled (``explain()``)
    plain_why = "a plain Dataset"

    def __init__(self, dataset, options, given: dict, plain_why: str = ""):
        super().__init__(dataset, options, given)
        self.plain_why = plain_why or self.plain_why
        self.batched = self.batch_sampler is not None   # torch's auto-collation (batch_size=None: none)
        if not hasattr(dataset, "make_work"):   # a torch Dataset's copy-on-read growth in forked workers
            forked = resolve_context(self.context).get_start_method() == "fork"
            self.memory_watch = CopyOnReadWatch(dataset, forked=forked)

    def identity(self) -> str:
        if hasattr(self.dataset, "make_work"):
            return self.dataset.identity()
        return super().identity()

    def build_work(self):
        self.apply_budget(self.plan_budget())
        if hasattr(self.dataset, "make_work"):  # a dataset that batches itself (feedgpu.tabular)
            return self.dataset.make_work(self.seed)
        return DatasetWork(self.dataset, self.options.collate, self.seed, batched=self.batched)

    def explain(self) -> str:
        return plain_explanation(self.dataset, self.plain_why)


def plain_explanation(dataset, why: str) -> str:
    return (f"dataset: {type(dataset).__name__} (dataset[i] in feedgpu's workers, then collate_fn, "
            f"as torch's loader)\nnot compiled: {why}")


class TorchvisionDatasetBackend(DatasetBackend):
    """A torchvision dataset with its transforms compiled (:class:`~feedgpu.torchvision.TorchvisionBackend`).

    The dataset is followed as torch's loader reads it: when an iteration starts, a dataset whose
    ``transform``, ``target_transform``, ``loader`` or ``Subset.indices`` changed since it was
    compiled is compiled again, unless persistent workers run, which keep the dataset they
    started with (as torch's do; ``loader.shutdown()`` restarts them)."""

    def __init__(self, dataset, options, given: dict, compiled: TorchvisionBackend, compile: bool = True):
        super().__init__(dataset, options, given)
        self.compiled, self.compile = compiled, compile
        self.memory_watch = None   # the compiled path reads files in the workers: no dataset copy grows
        self._logged = False

    def _workers_keep_copy(self) -> bool:
        """Persistent workers are running: they keep the dataset they started with (torch's too)."""
        return bool(self.persistent_workers) and self.pool is not None and not self.pool.closed

    def begin(self) -> None:
        if self.compiled is None or self.compiled.current(self.dataset) or self._workers_keep_copy():
            return
        self.release_pool(force=True)   # the work made from the old dataset goes
        self.fingerprint = None   # state_dict()'s: the dataset's length may have changed
        self.compiled, why = backend_for(self.dataset, self.compile)
        self.plain_why = why or self.plain_why

    def build_work(self):
        if self.compiled is None:   # no longer compiled: a plain Dataset now
            return super().build_work()
        self.apply_budget(self.plan_budget())
        if not self._logged:   # when the loader's first iteration starts
            self._logged = True
            log.info("%s", self.compiled.summary())
        found, compiled = self.compiled.found, self.compiled.compiled
        work = slot_work(found, compiled, collate=self.options.collate, seed=self.seed, batch_size=self.batch_size,
                         workers=self.num_workers, prefetch=self.prefetch, batched=self.batched,
                         fixed_pool=self.autoscaler is None and not self.options.executor.remote,
                         positional=self.user is not None)   # batches written in shared memory
        if work is not None:
            return work
        return TorchvisionWork(found, compiled, self.options.collate, self.seed, batched=self.batched,
                               positional=self.user is not None)

    def explain(self) -> str:
        backend = self.compiled
        if backend is not None and not backend.current(self.dataset):
            if self._workers_keep_copy():
                return backend.explain() + "\nthe dataset changed since the persistent workers started: they keep " \
                                           "it as it was (as torch's do) until loader.shutdown()"
            backend, why = backend_for(self.dataset, self.compile)   # what the next iteration compiles
            if backend is None:
                return plain_explanation(self.dataset, why)
        if backend is not None:
            return backend.explain()
        return plain_explanation(self.dataset, self.plain_why)
