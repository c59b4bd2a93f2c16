"""``sim.py --run-config``: ``key=value`` pairs (TOML values), a preset ``.toml`` file, or both.

Flower's own parser (``flwr run --run-config``) turns every mistake into one generic message or a
traceback; this one names the key or token.  A preset file may be combined with ``key=value``
overrides, which win (Flower's parser refuses the combination).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import tomllib

from fedderm.config import ConfigError

# a key, "=", then a double- or single-quoted value or a run of non-blanks (as Flower's parser);
# a bracketed list/inline table may hold spaces and is taken whole
_PAIR = re.compile(r"""\s*([^\s=]+)=("[^"]*"|'[^']*'|\[[^\]]*\]|\{[^}]*\}|\S+)""")


_ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """A docstring as a command's ``--help`` shows it: reStructuredText's literals and roles as
    their plain text (``flwr run`` -> flwr run, :func:`f` -> f)."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


def _value(key: str, text: str) -> Any:
    """The TOML value ``text`` of ``key``, or a ConfigError naming the key and the fix."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if re.fullmatch(r"[A-Za-z_][\w.\-/~]*", text):
        raise ConfigError(
            f"run-config key {key!r}: {text} is not a value; strings go in double quotes: "
            f'{key}="{text}" (quote the whole list in single quotes for the shell)'
        )
    raise ConfigError(
        f"run-config key {key!r}: {text!r} is not a TOML value (numbers, true/false, "
        "or strings in double quotes)"
    )


def parse_pairs(text: str, seen: dict[str, Any] | None = None) -> dict[str, Any]:
    """``'k1=v1 k2="v 2"'`` -> ``{"k1": v1, "k2": "v 2"}``; a stray token or a key given twice is a
    ConfigError naming it.  ``seen`` holds the pairs of earlier arguments (duplicates across them)."""
    seen = {} if seen is None else seen
    out: dict[str, Any] = {}
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _PAIR.match(text, pos)
        if not m:
            token = text[pos:].split()[0]
            raise ConfigError(
                f"run-config: {token!r} is not key=value (TOML values, strings in double quotes, "
                'e.g. method="fedprox" lr=0.01)'
            )
        key = m.group(1).strip("\"'")
        if key in out or key in seen:
            raise ConfigError(f"run-config key {key!r} is given twice")
        out[key] = _value(key, m.group(2))
        pos = m.end()
    return out


def flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables as flat run-config keys (``[fedclf]`` ``queue-size`` -> ``fedclf.queue-size``)."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def read_preset(path: str) -> dict[str, Any]:
    """A TOML file of flat run-config keys (``presets/*.toml``), flattened (``[fedclf]`` tables
    become ``fedclf.<key>``); a missing or malformed file is a ConfigError naming it."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"run-config file {path!r} not found")
    try:
        return flatten(tomllib.loads(file.read_text()))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"run-config file {path!r}: {err}") from None


def parse_run_config(args: list[str] | None) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """``--run-config`` arguments -> (effective overrides, preset path or "", the ``key=value`` overrides).

    At most one argument may be a ``.toml`` file (a preset); ``key=value`` pairs, in the same or
    other arguments, override it.
    """
    preset, overrides = "", {}
    for arg in args or []:
        if arg.strip().endswith(".toml") and "=" not in arg:
            if preset:
                raise ConfigError(f"run-config: two preset files ({preset!r}, {arg.strip()!r}); give one")
            preset = arg.strip()
        else:
            overrides.update(parse_pairs(arg, overrides))
    base = read_preset(preset) if preset else {}
    return {**base, **overrides}, str(Path(preset).expanduser().resolve()) if preset else "", overrides
