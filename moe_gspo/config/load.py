"""Configs from YAML and `section.key=value` overrides: type checks, unknown keys, and which file or override
set a bad value."""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from pathlib import Path

import yaml

from moe_gspo.config.checks import ConfigError
from moe_gspo.config.run import CompareConfig, Config


class _Loader(yaml.SafeLoader):
    """YAML 1.2-style booleans: only true/false (YAML 1.1 would read `off`, `on`, `yes`, `no` as bools, turning
    `algorithm.routing_replay: off` into False)."""


_Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)



def _coerce(value, tp, where: str):
    """Check/convert a YAML or override value to the annotated type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is dict:  # free-form options (algorithm.loss_options): their owner checks them
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise ConfigError(f"{where}={value!r} must be a mapping of names to values")
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, (list, tuple)):
            return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        raise ConfigError(f"{where}={value!r} must be a list")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be a bool (true/false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be an int")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}={value!r} must be a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}={value!r} must be a string")
    raise ConfigError(f"{where}: unsupported type {tp}")


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown config key '{path}'; valid keys under '{where or 'config'}': {sorted(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, path)
        else:
            kwargs[key] = _coerce(value, tp, path)
    return cls(**kwargs)


def config_from_dict(data: dict) -> Config:
    """Build a validated Config from a nested dict (unknown keys and wrong types raise ConfigError)."""
    return _build(Config, data or {}, "")


def _parse_scalar(text: str):
    return _yaml_load(text) if text != "" else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` strings (values parsed as YAML scalars) to a nested dict."""
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form section.key=value")
        key, text = ov.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {ov!r}: '{p}' is not a section")
        node[parts[-1]] = _parse_scalar(text)
    return data


def read_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """The mapping in a YAML config file (empty file: {}); a missing file or bad YAML raises one line naming it.

    A file may start from another: `base: OTHER.yaml` (relative to the file) reads OTHER first, then this file's
    sections override it key by key (a mapping merges into the base's mapping, anything else replaces it)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _yaml_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = " ".join(str(getattr(e, "problem", None) or e).split())  # one line
        raise ConfigError(f"{where}: invalid YAML: {what}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base={base!r} must be the path of another config file")
    chain = (*_chain, path.resolve())
    if (path.parent / base).resolve() in chain:
        raise ConfigError(f"{path}: base={base!r} makes a cycle ({' -> '.join(p.name for p in chain)} -> {base})")
    return _merged(read_yaml(path.parent / base, chain), data)


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (or nothing: defaults), apply overrides, validate. A comparison's config gives its shared
    config: the `compare:` section (variants and their settings, which `moe-gspo compare` reads) is left out, so
    `moe-gspo train --config <comparison config> <a variant's overrides>` trains one run of it."""
    data: dict = read_yaml(path) if path is not None else {}
    data.pop("compare", None)
    from_file = copy.deepcopy(data)
    data = apply_overrides(data, list(overrides or []))
    given = {o.split("=", 1)[0].strip() for o in overrides or [] if "=" in o}
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    before = from_file.get("rollout") if isinstance(from_file.get("rollout"), dict) else {}
    if "rollout.task" in given and "rollout.task_args" not in given and rollout.get("task") != before.get("task"):
        rollout.pop("task_args", None)  # the file's knobs were for the task the command line replaced
    try:
        return config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{_culprit(path, from_file, overrides, e)}: {e}") from None


def _culprit(path, from_file: dict, overrides, err: ConfigError) -> str:
    """Who set the value `err` is about: the YAML file, or the command-line overrides when the file alone is valid
    (or fails differently)."""
    if overrides:
        try:
            config_from_dict(from_file)
            alone = None
        except ConfigError as e:
            alone = str(e)
        if alone != str(err):
            last = {o.split("=", 1)[0].strip(): o for o in overrides}  # the last override of a key wins
            named = [o for k, o in last.items() if k in str(err)]
            return f"command-line override {' '.join(named or overrides)}"
    return str(path) if path is not None else "config"


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def compare_config_from_dict(data: dict) -> CompareConfig:
    """A validated CompareConfig from the `compare:` mapping without its `variants` (unknown keys raise)."""
    return _build(CompareConfig, data or {}, "compare")
