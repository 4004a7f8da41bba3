"""Fit statistics of a table pipeline, stored as versioned JSON and reused.

A fit file holds, for each stage with statistics (mean/median, mean/std, min/max, quantile
boundaries, vocabularies with counts), its configuration and its state, plus:

* ``format``: :data:`FIT_FORMAT` (a file of another format is refitted or, with
  ``mode: load``, refused);
* ``spec``: hash of the source identity, the joins and every stage's configuration; a file whose
  spec differs from the pipeline's was fitted for something else;
* ``hash``: blake2b-128 of the states, which joins the pipeline's fingerprint
  (:meth:`TablePipeline.fingerprint`), so a new vocabulary means a new fingerprint.

Statistics come from a seeded uniform sample of at most ``max_rows`` rows (all rows when the
table is smaller), passed through the joins and the stages before each fitted one.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import ConfigError

FIT_FORMAT = "feedgpu.tabular.fit/1"


def digest(obj) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=16).hexdigest()


class FitStore:
    """States by stage key, read from and written to ``path`` (``None``: in memory only)."""

    def __init__(self, path: str | os.PathLike | None, spec: str, mode: str = "auto"):
        self.path, self.spec, self.mode = (Path(path) if path else None), spec, mode
        self.states: dict[str, dict] = {}
        self.loaded = False
        if self.path is not None and mode != "refit" and self.path.exists():
            doc = json.loads(self.path.read_text())
            if doc.get("format") != FIT_FORMAT:
                if mode == "load":
                    raise ConfigError(f"{self.path}: fit file format {doc.get('format')!r}, expected {FIT_FORMAT!r}")
            elif doc.get("spec") != spec:
                if mode == "load":
                    raise ConfigError(f"{self.path}: fitted for another source or stage definition (spec differs); "
                                      "use fit.mode: refit")
            else:
                if digest(doc["stages"]) != doc.get("hash"):
                    raise ConfigError(f"{self.path}: fit file damaged (hash does not match its states)")
                self.states = {s["key"]: s["state"] for s in doc["stages"]}
                self.loaded = True
        elif mode == "load":
            raise ConfigError(f"fit.mode is load but there is no fit file at {self.path}")
        self.entries: list[dict] = []

    def get(self, key: str):
        return self.states.get(key)

    def put(self, key: str, config: dict, state: dict) -> None:
        self.states[key] = state
        self.entries.append({"key": key, "config": config, "state": state})

    def hash(self) -> str:
        return digest([{"key": k, "state": v} for k, v in sorted(self.states.items())])

    def document(self) -> dict:
        stages = self.entries
        return {"format": FIT_FORMAT, "spec": self.spec, "stages": stages, "hash": digest(stages)}

    def save(self) -> None:
        if self.path is None or self.loaded:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.document(), indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)
