"""The throughput balancer: pure policy, measurements in, decisions out.

Nothing here starts a process, reads a clock or touches a GPU. The loader measures a window
(a second or more of training, :mod:`feedgpu.balancer.autoscale`), builds a :class:`Measurement`,
asks :meth:`Policy.decide` and applies the :class:`Decision` before the next window. Given the
same measurements, the policy makes the same decisions.

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

Units: rates in samples per second, times in seconds, CPU in cores, memory in bytes,
fractions in [0, 1].
"""
from .diagnosis import WAIT_THRESHOLD, Diagnosis, diagnose
from .measurement import ENGINES, KINDS, Decision, Measurement, _fmt_rate, _pct
from .placement import PLACEMENT_TOLERANCE, EngineRate, Placement, choose_placement
from .policy import Policy
from .policy_config import DRIFT_THRESHOLD, TOLERANCE, PolicyConfig, start_workers
from .window import Record

__all__ = sorted([
    "DRIFT_THRESHOLD", "Decision", "Diagnosis", "ENGINES", "EngineRate", "KINDS", "Measurement",
    "PLACEMENT_TOLERANCE", "Placement", "Policy", "PolicyConfig", "Record", "TOLERANCE", "WAIT_THRESHOLD",
    "choose_placement", "diagnose", "start_workers",
])
