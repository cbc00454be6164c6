"""Launch policies as text: ``'name=value,...'`` <-> a frozen policy dataclass (AttentionPolicy,
PlanRules), for benchmark and tool command lines. One reader for every policy class."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional


def parse_spec(default, spec: str, convert: Optional[dict] = None):
    """``default`` with the fields ``spec`` names replaced. Values: 0, 1, true or false for a bool
    field; an integer; ``none`` for an Optional field; integers joined by ``x`` for a tuple field
    (``convert[name]`` maps that tuple onto the field's shape). An empty spec is ``default``; a
    pair that is not NAME=VALUE for a field raises ValueError listing the fields."""
    cls = type(default)
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    changes = {}
    for pair in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, text = (s.strip() for s in pair.partition("="))
        if name not in fields or not eq:
            raise ValueError(f"policy {spec!r}: {pair!r} is not NAME=VALUE for a field of {cls.__name__} "
                             f"({', '.join(fields)})")
        changes[name] = _value(spec, name, str(fields[name]), text, (convert or {}).get(name))
    return dataclasses.replace(default, **changes)


def spec_of(policy, default) -> str:
    """The fields of ``policy`` that differ from ``default``, as ``parse_spec`` reads them."""
    def text(v):
        if isinstance(v, bool):
            return str(int(v))
        if isinstance(v, tuple):
            return "x".join(text(x) for x in _flat(v))
        return "none" if v is None else str(v)
    return ",".join(f"{f.name}={text(v)}" for f in dataclasses.fields(policy)
                    if (v := getattr(policy, f.name)) != getattr(default, f.name))


def _flat(t: tuple) -> tuple:
    return tuple(y for x in t for y in (_flat(x) if isinstance(x, tuple) else (x,)))


def _value(spec: str, name: str, kind: str, text: str, convert: Optional[Callable]):
    if kind.startswith("Optional") and text.lower() == "none":
        return None
    if kind in ("bool", "Optional[bool]"):
        value = {"0": False, "1": True, "false": False, "true": True}.get(text.lower())
        if value is None:
            raise ValueError(f"policy {spec!r}: {name} takes 0, 1, true or false, got {text!r}")
        return value
    if "tuple" in kind:
        parts = text.lower().split("x")
        if not all(p.lstrip("-").isdigit() for p in parts):
            raise ValueError(f"policy {spec!r}: {name} takes integers joined by x, got {text!r}")
        value = tuple(int(p) for p in parts)
        return convert(value) if convert else value
    if not text.lstrip("-").isdigit():
        raise ValueError(f"policy {spec!r}: {name} takes an integer, got {text!r}")
    return int(text)
