"""Counter-based random numbers for the built-in random stages: a pure function of
``(seed, epoch, sample index, stage position, draw number)``, computed for a whole batch at once.

The Python engine (one sample at a time) and the DALI engine (one batch at a time) call the same
function, so both crop and flip every sample identically, whatever the worker count, the order
samples are processed in or the batch they land in, and an epoch resumed mid-way draws what it
would have drawn.

Each value is the SplitMix64 output function (Steele, Lea & Flood, "Fast splittable pseudorandom
number generators", OOPSLA 2014; constants from Vigna's ``splitmix64.c``) applied to a key that
chains the seed, the epoch, the stage position and the sample index through the same function,
plus the draw number times the golden-ratio increment. The top 53 bits give a float64 uniform in
``[0, 1)``. Keying the generator per sample costs a few integer operations per sample, where a
NumPy ``Generator`` seeded through ``SeedSequence`` (``sample_rng``, which custom stages still
get) costs far more than the draws it then makes.
"""
from __future__ import annotations

import functools
import operator

import numpy as np

_MASK = 0xFFFFFFFFFFFFFFFF
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_UNIT = 1.0 / (1 << 53)


def _mix_int(z: int) -> int:
    """SplitMix64's output function on a Python int (mod 2**64)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on a uint64 array (wrapping arithmetic, in place)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(_M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_M2)
    z ^= z >> np.uint64(31)
    return z


@functools.lru_cache(maxsize=64)
def _key(seed: int, epoch: int, stage_pos: int) -> int:
    return _mix_int(_mix_int(_mix_int(seed + _GAMMA) ^ (epoch & _MASK)) ^ (stage_pos & _MASK))


def sample_uniforms(seed: int, epoch: int, indices, stage_pos: int, k: int) -> np.ndarray:
    """Uniform draws in ``[0, 1)`` for each sample of ``indices``: float64 array ``(n, k)``;
    row ``i`` holds draws ``0 .. k-1`` of :class:`Draws` ``(seed, epoch, indices[i], stage_pos)``.

    Args:
        seed: base seed (any int; taken mod 2**64, as :func:`~feedgpu.stages.base.sample_rng`).
        epoch: epoch number (>= 0).
        indices: sample indices in the source (ints, any shape flattened to ``n``).
        stage_pos: the stage's position in the pipeline.
        k: draws per sample (>= 0).
    """
    key = _key(int(seed), int(epoch), int(stage_pos))
    idx = np.asarray(indices, np.int64).reshape(-1).astype(np.uint64)
    with np.errstate(over="ignore"):
        base = _mix(idx * np.uint64(_GAMMA) ^ np.uint64(key))
        z = base[:, None] + np.arange(1, k + 1, dtype=np.uint64) * np.uint64(_GAMMA)
        _mix(z)
    return (z >> np.uint64(11)).astype(np.float64) * _UNIT


class Draws:
    """One sample's draws, computed when indexed: ``draws[j]`` is a float in ``[0, 1)``, the
    same value as ``sample_uniforms(seed, epoch, [index], stage_pos, j + 1)[0, j]`` (computed on
    demand, so a stage pays only for the draws it uses)."""

    __slots__ = ("_base",)

    def __init__(self, seed: int, epoch: int, index: int, stage_pos: int):
        self._base = _mix_int(((int(index) * _GAMMA) & _MASK) ^ _key(int(seed), int(epoch), int(stage_pos)))

    def __getitem__(self, j: int) -> float:
        j = operator.index(j)   # a NumPy integer too (its arithmetic would overflow int64 below)
        if j < 0:
            raise IndexError("draw numbers start at 0")
        return (_mix_int(self._base + (j + 1) * _GAMMA) >> 11) * _UNIT


def as_uniforms(rng, k: int):
    """A stage's ``rng`` argument as ``k`` uniform draws indexable by ``[j]``: :class:`Draws` or
    a row of :func:`sample_uniforms` (a sequence of at least ``k`` floats) as it is; a NumPy
    ``Generator`` (a caller's own) gives ``rng.random(k)`` as a list."""
    if isinstance(rng, np.random.Generator):
        return rng.random(k).tolist()
    if not isinstance(rng, Draws) and len(rng) < k:
        raise ValueError(f"expected {k} uniform draws, got {len(rng)}")
    return rng
