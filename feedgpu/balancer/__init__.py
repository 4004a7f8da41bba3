"""The throughput balancer: how many workers (or DALI threads) and how deep a prefetch keep the
training loop fed, decided by experiment from measured windows.

The core is pure policy, measurements in, decisions out: nothing in it starts a process, reads a
clock or touches a GPU, and given the same measurements it makes the same decisions. The loader
measures a window (a second or more of training, :mod:`.autoscale`), builds a
:class:`Measurement`, asks :meth:`Policy.decide` and applies the :class:`Decision` before the
next window.

Modules, each tested apart:

* :mod:`.measurement`: :class:`Measurement` and :class:`Decision`, what loader and policy
  exchange.
* :mod:`.window`: the record of the windows seen at each setting (means, spreads, the noise
  of one window, drift).
* :mod:`.policy_config`: :class:`PolicyConfig`, the policy's constants and bounds.
* :mod:`.policy`: :class:`Policy`, which finds the worker count and prefetch depth at which the
  training loop trains fastest, by experiment (its module doc gives the rules).
* :mod:`.verdict`: whether one step is kept, from the records of the two settings;
  :mod:`.second_look`: a step undone from its settle window, a kept step judged again;
  :mod:`.neighbours`: which steps may be tried next; :mod:`.limits`: the hard limits (the
  configured maximum, the memory budget); :mod:`.trial`: what the policy holds about a step
  in progress and a step it refused.
* :mod:`.diagnosis`: :func:`diagnose`, whether the loader keeps the loop fed and if not why.
* :mod:`.placement`: :func:`choose_placement`, which engine the stages run on, from measured
  rates.
* :mod:`.text`: the numbers of reasons and log lines in words (rates, percentages, GiB).
* :mod:`.remote_policy`: :class:`~.remote_policy.RemotePolicy`, pure too, in front of
  :class:`Policy` when Ray workers may join: the count of remote workers, once the local pool
  cannot grow.

Around the core:

* :mod:`.autoscale`: :class:`~.autoscale.Autoscaler`, the impure half: it reads the clock and
  the process's CPU and memory, builds each window's :class:`Measurement` and hands the
  policy's decision to the loader; also the starting worker count (from the cores,
  :func:`feedgpu.host.cpu_cores`).
* :mod:`.simulate`: a simulated producer and consumer (throughput curves, noise) that drives a
  :class:`Policy` over windows, for the balancer's tests and ``bench/policy_sim.py``.

Units: rates in samples per second, times in seconds, CPU in cores, memory in bytes,
fractions in [0, 1].
"""
from .diagnosis import WAIT_THRESHOLD, Diagnosis, diagnose
from .measurement import ENGINES, KINDS, Decision, Measurement
from .placement import PLACEMENT_TOLERANCE, EngineRate, Placement, choose_placement
from .policy import Policy
from .policy_config import DRIFT_THRESHOLD, TOLERANCE, PolicyConfig, start_workers
from .window import Record

__all__ = sorted([
    "DRIFT_THRESHOLD", "Decision", "Diagnosis", "ENGINES", "EngineRate", "KINDS", "Measurement",
    "PLACEMENT_TOLERANCE", "Placement", "Policy", "PolicyConfig", "Record", "TOLERANCE", "WAIT_THRESHOLD",
    "choose_placement", "diagnose", "start_workers",
])
