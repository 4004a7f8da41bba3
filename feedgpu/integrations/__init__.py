"""Glue between :class:`feedgpu.DataLoader` and training frameworks that replace a loader with
their own (:mod:`feedgpu.integrations.accelerate`). Each module imports its framework; importing
this package imports none of them, and ``import feedgpu`` imports neither.
"""
