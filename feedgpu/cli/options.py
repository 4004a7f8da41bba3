"""Option parsing shared by the ``feedgpu`` commands."""
from __future__ import annotations

import click

__all__ = ["parse_sets"]


def parse_sets(sets: tuple[str, ...]) -> dict:
    """``--set KEY=VALUE`` options -> ``{dotted key: value}``, each value read as YAML data
    (``64`` an int, ``[1, 2]`` a list). Raises :class:`click.BadParameter` for an option without
    ``=`` or a value that is not plain YAML."""
    import yaml

    out = {}
    for s in sets:
        key, eq, value = s.partition("=")
        if not eq:
            raise click.BadParameter(f"{s!r}: expected KEY=VALUE (e.g. loader.batch_size=64)", param_hint="--set")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise click.BadParameter(f"{s!r}: the value is not plain YAML data ({e})", param_hint="--set") from None
    return out
