"""The model families, one file each: every module of this folder but `base` defines a `Family` subclass with
`FAMILY = TheFamily()`, and is registered by name when the package is imported. Adding a family is adding a file.

    from moe_gspo.model.families import family, names
    family("gpt_oss").linear_biases      # True
    names()                              # ('qwen3_moe', 'mixtral', ...), the default first

This package sits below the config layer (the config checks a family's fields when a ModelConfig is made); it
imports nothing else of moe_gspo."""

from __future__ import annotations

import importlib
import pkgutil

from moe_gspo.model.families.base import Family, FamilyError

DEFAULT = "qwen3_moe"
"""model.family's default, and the model_type assumed for a config.json without one."""

_REGISTRY: dict[str, Family] = {}


def _load() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == "base" or info.name.startswith("_"):
            continue
        fam = importlib.import_module(f"{__name__}.{info.name}").FAMILY
        if fam.name != info.name:
            raise RuntimeError(f"{__name__}.{info.name} defines family {fam.name!r}: a family's file is its name")
        _REGISTRY[fam.name] = fam


_load()


def names() -> tuple[str, ...]:
    """Every registered family's name, the default first, then alphabetically."""
    return (DEFAULT, *sorted(n for n in _REGISTRY if n != DEFAULT))


def family(name: str) -> Family:
    """The registered family `name`; FamilyError naming the families there are."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise FamilyError(f"model family {name!r} is not one of {', '.join(names())}") from None


def every() -> list[Family]:
    """Every registered family, in names() order."""
    return [_REGISTRY[n] for n in names()]


def own_field_classes() -> tuple[type, ...]:
    """The dataclasses of the families' own ModelConfig fields (ModelConfig's bases)."""
    return tuple(f.fields for f in every() if f.fields is not None)


__all__ = ["DEFAULT", "Family", "FamilyError", "every", "family", "names", "own_field_classes"]
