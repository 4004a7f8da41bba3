"""The common front of the ``engine:`` and ``executor:`` settings: a name or a mapping of fields."""
from __future__ import annotations

from ..errors import ConfigError


def section_fields(value, section: str, expected: str, allowed: tuple[str, ...]) -> dict:
    """``value`` as a mapping of fields: a name ``"x"`` is ``{"name": "x"}``.

    Args:
        value: a name (str) or a mapping.
        section: the setting's key, for messages (``"engine"``).
        expected: the names it takes, for messages (``"'python', 'dali'"``).
        allowed: the field names, in the order the message lists them.

    Raises :class:`ConfigError` for another type or an unknown key.
    """
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{section}: expected {expected} or a mapping, got {value!r}")
    unknown = set(value) - set(allowed)
    if unknown:
        raise ConfigError(f"{section}: unknown keys {sorted(unknown)}; allowed: {', '.join(allowed)}")
    return value
