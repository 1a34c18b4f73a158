"""Reading a config: a YAML file (or a shipped config's name) plus ``key.path=value`` overrides, validated
into one line per error; and writing it back."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.dataclasses import is_pydantic_dataclass

from data_pipeline import DataError
from megatransformer.config.core import BOOLEAN_NUMBER, ConfigError, Section
from megatransformer.config.run import RunConfig

if TYPE_CHECKING:  # (torch is imported where it is used: the CLI starts without it)
    import torch


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested dict; values are read by :func:`override_value`."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        value = override_value(text)
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return raw


def override_value(text: str) -> Any:
    """An override's value: a YAML scalar, or a ``[...]`` / ``{...}`` collection; any other text is the string as
    written (``ROMEO:``, ``- a``, ``# x`` and text YAML cannot parse), as a shell user means it."""
    if not text:
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, (dict, list)) and not text.lstrip().startswith(("[", "{")):
        return text
    if value is None and text.strip() not in ("null", "Null", "NULL", "~"):
        return text
    return value


def shipped_configs() -> dict[str, Path]:
    """The configs that ship with megatransformer, by name (``quickstart``, ``llama-style``, ...).

    The repository's top-level ``configs/`` directory is installed as the package ``megatransformer.configs``
    (pyproject.toml maps it), so an installed copy finds them with importlib.resources; a source checkout
    (plain or editable) reads the same directory beside the package.
    """
    from importlib.resources import files

    package = Path(str(files("megatransformer")))
    directory = package / "configs"
    if not directory.is_dir():
        directory = package.parent / "configs"
    return {p.stem: p for p in sorted(directory.glob("*.yaml"))}


def resolve_config(path: str | Path) -> Path:
    """A config file: an existing path as given, else a shipped config named ``path`` (``llama-style`` or
    ``llama-style.yaml``)."""
    given = Path(path)
    if given.exists() and not given.is_dir():
        return given
    shipped = shipped_configs()
    name = given.name[: -len(".yaml")] if given.name.endswith(".yaml") else given.name
    if given.parent == Path(".") and name in shipped:
        return shipped[name]
    if name in shipped:  # (a path into a clone's configs/, given outside one)
        raise ConfigError(f"config file {path} does not exist here; the shipped config of that name is --config {name}")
    raise ConfigError(
        f"config file {path} does not exist; give a YAML path or the name of a shipped config ({', '.join(shipped)})"
    )


def load_config(path: str | Path | None, overrides: list[str] = (), schema: type[Section] = RunConfig):
    """Read a YAML run description (a path or a shipped config's name), apply overrides and validate it
    into ``schema``."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = resolve_config(path)
        try:
            raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {str(err).splitlines()[0]}") from None
        if raw is None and path.is_file():  # (a file cut short or the wrong one; /dev/null is no file: no settings)
            raise ConfigError(
                f"config file {path} is empty: every setting would be its default; write the settings to change "
                "in it, or `{}` to mean the defaults"
            )
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(raw).__name__}")
    raw = apply_overrides(raw, list(overrides))
    refuse_retired(raw)
    try:
        return schema.model_validate(raw)
    except ValidationError as err:
        if not _keep_typed_text(raw, list(overrides), err):
            raise ConfigError(_describe(err, schema)) from None
    return validate(raw, schema)


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping: plain YAML keeps the last one, so a
    repeated ``train:`` section would silently replace the first. (Keys merged in with ``<<`` may still be
    overridden, as YAML intends.)"""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} on line {line} (first on line {first_line[key]})"
                )
            first_line[key] = line
        return super().construct_mapping(node, deep)


def _keep_typed_text(raw: dict[str, Any], overrides: list[str], err: ValidationError) -> bool:
    """An override of a field that holds text keeps the text as typed (``train.sample_prompt=123`` or ``=yes``),
    not the number or boolean YAML read in it: put back in ``raw``; whether any was."""
    typed = {tuple(key.split(".")): text for key, _, text in (item.partition("=") for item in overrides)}
    kept = False
    for error in err.errors():
        loc = tuple(str(part) for part in error["loc"])
        if error["type"] == "string_type" and loc in typed:
            node = raw
            for part in loc[:-1]:
                node = node[part]
            node[loc[-1]] = typed[loc]
            kept = True
    return kept


RETIRED = {
    "checkpoint.dtype": "it set nothing; `megatransformer export --dtype` sets the dtype of exported weights",
}
"""Keys this version no longer has, and why: refused in a config, dropped from a config a checkpoint saved."""


def refuse_retired(raw: dict[str, Any]) -> None:
    for key, why in RETIRED.items():
        if _pop(raw, key, dry=True):
            raise ConfigError(f"{key} is no longer a setting ({why}); remove it")


def without_retired(raw: dict[str, Any]) -> dict[str, Any]:
    """A saved config without the keys of :data:`RETIRED` (they changed nothing where they were written)."""
    for key in RETIRED:
        _pop(raw, key)
    return raw


def _pop(raw: Any, key: str, dry: bool = False) -> bool:
    """Whether ``raw`` has the dotted ``key``; removed unless ``dry``."""
    *sections, name = key.split(".")
    for section in sections:
        raw = raw.get(section) if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or name not in raw:
        return False
    if not dry:
        del raw[name]
    return True


def validate(raw: dict[str, Any], schema: type[Section] = RunConfig):
    try:
        return schema.model_validate(raw)
    except ConfigError:
        raise
    except ValidationError as err:
        raise ConfigError(_describe(err, schema)) from None


def _describe(err: ValidationError, schema: type[Section]) -> str:
    """Turn pydantic's most useful error into one line; for unknown keys suggest the closest valid key."""
    errors = err.errors()
    # an unknown key first; then a value out of range (in a union, rather than "not a string" for the other member)
    first = next((e for e in errors if e["type"] in _UNKNOWN_KEY), None) or next(
        (e for e in errors if e["type"] in _BOUNDS or e["type"] == "finite_number"), errors[0]
    )
    parts = [p for p in first["loc"] if not _is_union_tag(p)]
    loc = [str(p) for p in parts]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    if first["type"] in _UNKNOWN_KEY:
        section = _section_at(schema, [p for p in loc[:-1] if not p.isdigit()])
        valid = list(_fields(section)) if section else []
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f"did you mean {'.'.join(loc[:-1] + close)!r}?" if close else f"valid keys: {', '.join(valid)}"
        return f"unknown config key {where!r}; {hint}"
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):
        return str(cause)
    if isinstance(cause, DataError):  # (a data_pipeline settings check, its message led by its own field)
        return f"{where}.{cause}" if where else str(cause)
    if first["type"] in _BOUNDS:
        (bound,) = first["ctx"].values()
        return f"{where}={first['input']} must be {_BOUNDS[first['type']]} {_number(bound)}"
    if first["type"] == "finite_number":
        return f"{where}={first['input']} must be a finite number"
    if first["type"] == BOOLEAN_NUMBER:
        return f"{where}={str(first['input']).lower()} must be a number, not a boolean"
    if first["type"] == "string_too_short":
        return f"{where} must not be empty"
    return f"config key {where!r}: {first['msg']} (got {first.get('input')!r})"


_UNKNOWN_KEY = ("extra_forbidden", "unexpected_keyword_argument")
"""pydantic's errors for a key a section does not have (a model's, a dataclass's)."""
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
"""pydantic's range errors, as the comparison the value failed."""


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member it tried in the error location (``str``, ``list[X]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


def _section_at(schema: type[Section], loc: list[str]) -> type | None:
    node: type | None = schema
    for part in loc:
        field = _fields(node).get(part) if node else None
        node = _model_in(field.annotation) if field else None
    return node


def _fields(section: type) -> dict[str, Any]:
    """The fields of a config section: a pydantic model, or a pydantic dataclass of data_pipeline's."""
    return section.model_fields if issubclass(section, BaseModel) else section.__pydantic_fields__


def _model_in(annotation: Any) -> type | None:
    """The section class inside an annotation such as ``X``, ``list[X]`` or ``str | list[X] | None``."""
    if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or is_pydantic_dataclass(annotation)):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found:
            return found
    return None


def dump_config(cfg: Section) -> str:
    """The resolved config as YAML, in field order (what run directories store)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype of a run's ``precision`` (fp32 | bf16 | fp16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
