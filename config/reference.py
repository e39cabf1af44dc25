"""configs/base.yaml, written from the schema: every key with its default and, above it, its meaning and allowed
values, so the file a user reads cannot drift from what validation does. ``python -m config.reference`` rewrites
the file; a test keeps it equal to what this module writes."""

from __future__ import annotations

import os
import sys
import textwrap

import yaml

from config.keys import Key
from config.schema import SCHEMA, SECTIONS
from core.files import atomic_write_bytes

BASE_YAML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yaml")
WIDTH = 118
HEADER = """\
# Every key with its default. Presets inherit from this file with `base: base.yaml` and override
# what they change. Unknown keys are errors. Written by `python -m config.reference` from
# config/schema.py, where each key is declared; edit the schema, not this file.
"""


def _yaml(value) -> str:
    """One value as YAML writes it inline: a list in brackets, None as null."""
    return yaml.safe_dump(value, default_flow_style=True).split("\n")[0]


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH - len(indent) - 2, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ")


def _allowed(key: Key) -> str:
    """The values a key takes, beyond its meaning: a choice's, a range, the extra single values, null."""
    parts = []
    if key.kind == "choice":
        parts.append("one of " + ", ".join(_yaml(c) for c in key.choices))
    if key.minimum is not None and key.maximum is not None:
        parts.append(f"{key.minimum:g} to {key.maximum:g}")
    elif key.minimum is not None:
        parts.append(f"at least {key.minimum:g}")
    elif key.maximum is not None:
        parts.append(f"at most {key.maximum:g}")
    parts += [f"or {_yaml(v)}" for v in key.also]
    if key.nullable and key.kind != "choice":
        parts.append("or null")
    return f" ({', '.join(parts)})" if parts else ""


def _entry(name: str, key: Key, indent: str) -> list[str]:
    return [*_comment(key.help + _allowed(key), indent), f"{indent}{name}: {_yaml(key.default)}"]


def base_yaml() -> str:
    lines = HEADER.splitlines()
    for name, node in SCHEMA.items():
        lines.append("")
        if isinstance(node, Key):
            lines += _entry(name, node, "")
            continue
        lines += _comment(SECTIONS[name].__doc__.strip(), "")
        lines.append(f"{name}:")
        for key_name, key in node.items():
            lines += _entry(key_name, key, "  ")
    return "\n".join(lines) + "\n"


def main() -> int:
    atomic_write_bytes(BASE_YAML, base_yaml().encode())
    print(f"wrote {os.path.relpath(BASE_YAML)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
