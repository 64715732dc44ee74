"""Config loading: YAML recipes with ``defaults:`` inheritance, dotted overrides, typed validation.

A recipe is a YAML mapping. Its optional ``defaults:`` key names one parent recipe or a list
of them: a path relative to the recipe's folder, or the file name of a config shipped in the
repository's ``configs/`` (``defaults: grpo_tiny_cpu``, ".yaml" optional), used when no such
file sits next to the recipe. Parents are deep-merged in list order and the recipe itself is
merged last, so the child wins. Lists are replaced, not concatenated.

Command-line overrides, applied after the recipe:

- ``a.b.c=VALUE`` sets an existing key (``VALUE`` is parsed as YAML: ``2``, ``1e-5``, ``true``,
  ``null``, ``[1, 2]``); naming a key that does not exist is an error suggesting the nearest one,
- ``+a.b.c=VALUE`` adds a key that does not exist yet,
- ``~a.b.c`` deletes a key.

``${other.key}`` interpolations (and NeMo RL's ``${mul:a,b}``) are resolved by omegaconf after
the overrides. With a pydantic schema (:func:`load_typed_config`) the schema's defaults form
the bottom layer, so the models are the one source of defaults; recipes state only choices.
Every problem is raised as :class:`ConfigError` with the full dotted key path.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import to_jsonable_python

from nemo_rl.utils.errors import InputError

DEFAULTS_KEY = "defaults"

# The shipped recipes, which a recipe anywhere may name in ``defaults:`` by file name.
SHIPPED_CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"

ModelT = TypeVar("ModelT", bound=BaseModel)


class ConfigError(InputError, ValueError):
    """A recipe, an override or a value that does not fit the schema; the message says which."""


class ConfigModel(BaseModel):
    """Base of every typed config section: unknown keys are errors and values are not coerced.

    ``strict`` keeps YAML mistakes visible: ``"2"`` (quoted) is not an int, ``1`` is not a bool.
    """

    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------------------------------
# YAML parsing


class _Loader(yaml.SafeLoader):
    """YAML 1.1 safe loader that reads ``1e-5`` as a float and rejects duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# PyYAML only accepts floats with a dot ("1.0e-5"); accept "1e-5" and "5E3" too.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)

# NeMo RL recipes compute micro-batch token budgets with ${mul:a,b}.
if not OmegaConf.has_resolver("mul"):
    OmegaConf.register_new_resolver("mul", lambda a, b: a * b)


def parse_value(text: str) -> Any:
    """Parse an override value as YAML: ``"2"`` -> 2, ``"[1, 2]"`` -> [1, 2], ``""`` -> ``""``."""
    if text == "":
        return ""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse override value {text!r} as YAML: {exc}") from exc


def _read_yaml(path: Path) -> dict[str, Any]:
    """The mapping in one YAML file (an empty file is ``{}``)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} must hold a mapping at the top level, not a {type(data).__name__}"
        )
    return data


# ---------------------------------------------------------------------------------------------
# Recipes with defaults inheritance


def load_recipe(path: str | Path) -> DictConfig:
    """Load a recipe and its ``defaults:`` ancestors, merged child-over-parent, unresolved."""
    return _load_recipe(Path(path).resolve(), chain=())


def _load_recipe(path: Path, chain: tuple[Path, ...]) -> DictConfig:
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain[chain.index(path) :], path))
        raise ConfigError(f"defaults cycle: {cycle}")
    data = _read_yaml(path)
    parents = data.pop(DEFAULTS_KEY, None)
    if parents is None:
        parents = []
    elif isinstance(parents, str):
        parents = [parents]
    elif not (isinstance(parents, list) and all(isinstance(p, str) for p in parents)):
        raise ConfigError(
            f"{path}: '{DEFAULTS_KEY}' must be a file name or a list of file names, got {parents!r}"
        )
    layers = [_load_recipe(_find_parent(path, p), (*chain, path)) for p in parents]
    try:
        return OmegaConf.merge(*layers, OmegaConf.create(data))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot merge {path} over its defaults: {exc}") from exc


def _find_parent(recipe: Path, name: str) -> Path:
    """The file ``defaults:`` entry ``name`` of ``recipe`` names: ``name`` (then ``name.yaml``)
    in the recipe's folder; for a bare file name, then in :data:`SHIPPED_CONFIGS_DIR`.

    Raises:
        ConfigError: no such file, listing every path tried.
    """
    names = [name] if Path(name).suffix else [name, f"{name}.yaml"]
    folders = [recipe.parent]
    if Path(name).name == name:
        folders.append(SHIPPED_CONFIGS_DIR)
    tried = [(folder / n).resolve() for folder in folders for n in names]
    for candidate in tried:
        if candidate.is_file():
            return candidate
    message = (
        f"{recipe}: {DEFAULTS_KEY}: {name!r} names no file; tried {', '.join(map(str, tried))} "
        "(a path is relative to the recipe's folder; name a config of the repository's "
        "configs/ by its file name alone, e.g. defaults: grpo_tiny_cpu)"
    )
    shipped = sorted(p.stem for p in SHIPPED_CONFIGS_DIR.glob("*.yaml"))
    close = difflib.get_close_matches(Path(name).stem, shipped, n=1, cutoff=0.6)
    raise ConfigError(message + (f"; did you mean {close[0]!r}?" if close else ""))


# ---------------------------------------------------------------------------------------------
# Schema introspection


def _unwrap(annotation: Any) -> Any:
    """Strip ``Annotated`` and ``X | None`` down to the one non-None type (or return as is)."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return annotation


def _as_model(annotation: Any) -> type[BaseModel] | None:
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _item_annotation(annotation: Any) -> Any:
    """Element type of ``list[X]`` / ``tuple[X, ...]`` / ``dict[K, X]``, else None."""
    annotation = _unwrap(annotation)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (list, tuple, set, frozenset) and args:
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    return None


def _field_annotation(schema: type[BaseModel], loc: tuple[Any, ...]) -> Any:
    """The annotation found by following ``loc`` (field names and list indices) from ``schema``.

    Returns None when ``loc`` leaves the schema (an unknown key, or an untyped value).
    """
    annotation: Any = schema
    for part in loc:
        model = _as_model(annotation)
        if model is not None:
            field = model.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return None
            annotation = field.annotation
        else:
            annotation = _item_annotation(annotation)
            if annotation is None:
                return None
    return annotation


def _model_at(schema: type[BaseModel] | None, loc: tuple[Any, ...]) -> type[BaseModel] | None:
    return None if schema is None else _as_model(_field_annotation(schema, loc))


def schema_defaults(schema: type[BaseModel]) -> dict[str, Any]:
    """The defaults of ``schema`` as a plain nested dict; required fields are left out.

    Nested models are expanded field by field (not dumped from a default instance), so values
    a model validator derives from other fields stay ``None`` here and follow overrides.
    """
    out: dict[str, Any] = {}
    for name, field in schema.model_fields.items():
        model = _as_model(field.annotation)
        if field.is_required():
            if model is not None:
                out[name] = schema_defaults(model)
            continue
        if model is not None and field.default is not None:
            out[name] = schema_defaults(model)
            continue
        value = field.get_default(call_default_factory=True)
        out[name] = to_jsonable_python(value)
    return out


# ---------------------------------------------------------------------------------------------
# Overrides


def _dotted(parts: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(p) for p in parts)


def _unknown_key(parts: list[str], candidates: list[str]) -> str:
    """``unknown key a.b.typo; did you mean a.b.type?`` (or the valid keys when none is close)."""
    key, prefix = parts[-1], parts[:-1]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    message = f"unknown key {_dotted(parts)}"
    if close:
        return f"{message}; did you mean {_dotted([*prefix, close[0]])}?"
    where = _dotted(prefix) or "the top level"
    valid = ", ".join(sorted(candidates)) or "none"
    return f"{message}; valid keys at {where}: {valid}"


def apply_override(
    tree: dict[str, Any], override: str, schema: type[BaseModel] | None = None
) -> None:
    """Apply one ``key=value`` / ``+key=value`` / ``~key`` override to a plain nested dict in place.

    A key counts as existing when it is in ``tree`` or declared by ``schema`` at that level.
    """
    text = override.strip()
    if text.startswith("~"):
        mode, text = "delete", text[1:]
        if "=" in text:
            raise ConfigError(f"override {override!r}: '~' deletes a key and takes no '=value'")
        dotted, value = text, None
    else:
        mode = "add" if text.startswith("+") else "set"
        text = text.removeprefix("+")
        dotted, eq, raw = text.partition("=")
        if not eq:
            raise ConfigError(
                f"override {override!r} must look like key=value, +key=value or ~key"
            )
        value = parse_value(raw.strip())
    parts = dotted.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r}: empty key name in {dotted!r}")

    def fail(message: str) -> ConfigError:
        return ConfigError(f"{message} (in override {override!r})")

    node: Any = tree
    for depth, part in enumerate(parts):
        loc = tuple(parts[:depth])
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
                where = _dotted(parts[: depth + 1])
                raise fail(f"{where}: no item {part} in a list of {len(node)}")
            index = int(part)
            if last:
                if mode == "delete":
                    del node[index]
                elif mode == "add":
                    raise fail(f"{_dotted(parts)} already exists; drop the '+' to change it")
                else:
                    node[index] = value
                return
            node = node[index]
            continue
        if not isinstance(node, dict):
            raise fail(f"{_dotted(loc)} is not a section: it holds {_short_repr(node)}")
        model = _model_at(schema, loc)
        declared = list(model.model_fields) if model is not None else []
        known = part in node or part in declared
        if last:
            if mode == "delete":
                if part not in node:
                    raise fail(_unknown_key(parts, [*node]))
                del node[part]
            elif mode == "add":
                if part in node:
                    raise fail(f"{_dotted(parts)} already exists; drop the '+' to change it")
                node[part] = value
            elif known:
                node[part] = value
            else:
                raise fail(
                    _unknown_key(parts, sorted({*node, *declared}))
                    + " Prefix the override with '+' to add a new key."
                )
            return
        if not known and mode != "add":
            raise fail(_unknown_key(parts[: depth + 1], sorted({*node, *declared})))
        if node.get(part) is None:
            node[part] = {}
        node = node[part]


# ---------------------------------------------------------------------------------------------
# Public entry points


def _build_tree(
    path: str | Path, overrides: list[str], schema: type[BaseModel] | None
) -> dict[str, Any]:
    """Schema defaults < recipe chain < overrides, interpolations resolved, as plain containers."""
    recipe = load_recipe(path)
    layers = [OmegaConf.create(schema_defaults(schema))] if schema is not None else []
    try:
        merged = OmegaConf.merge(*layers, recipe)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path} does not fit the schema's layout: {exc}") from exc
    tree = OmegaConf.to_container(merged, resolve=False)
    assert isinstance(tree, dict)
    for override in overrides:
        apply_override(tree, override, schema)
    try:
        resolved = OmegaConf.to_container(
            OmegaConf.create(tree), resolve=True, throw_on_missing=True
        )
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f" at {key}" if key else ""
        message = str(exc).splitlines()[0]
        raise ConfigError(f"cannot resolve the config{where}: {message}") from exc
    assert isinstance(resolved, dict)
    return resolved  # type: ignore[return-value]


def load_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Load a recipe (with its ``defaults:``), apply ``overrides``, resolve interpolations."""
    return _build_tree(path, list(overrides or []), schema=None)


def load_typed_config(
    path: str | Path, overrides: list[str] | None, schema: type[ModelT]
) -> ModelT:
    """Like :func:`load_config` on top of ``schema``'s defaults, then validated by ``schema``."""
    tree = _build_tree(path, list(overrides or []), schema=schema)
    return validate_config(tree, schema, source=str(path))


def validate_config(data: dict[str, Any], schema: type[ModelT], source: str = "config") -> ModelT:
    """``schema.model_validate(data)``, with a :class:`ConfigError` listing every problem by key."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        problems = [_describe(error, schema) for error in exc.errors()]
        lines = "\n".join(f"  - {p}" for p in problems)
        noun = "problem" if len(problems) == 1 else "problems"
        raise ConfigError(f"invalid {source}: {len(problems)} {noun}:\n{lines}") from None


def as_config(cfg: ModelT | Mapping[str, Any], schema: type[ModelT], owner: str) -> ModelT:
    """``cfg`` as a ``schema`` object: an instance is returned as is, a mapping is validated.

    Lets a component take its config model or, as NeMo RL's components do, a plain mapping of
    the model's keys (missing keys take the model's defaults).

    Raises:
        ConfigError: the mapping does not fit ``schema`` (each problem named by key).
        TypeError: ``cfg`` is neither.
    """
    if isinstance(cfg, schema):
        return cfg
    if not isinstance(cfg, Mapping):
        raise TypeError(
            f"{owner} needs a {schema.__name__} or a mapping of its keys, got {type(cfg).__name__}"
        )
    return validate_config(dict(cfg), schema, source=f"{owner} config")


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(error: Any, schema: type[BaseModel]) -> str:
    """One line for one pydantic error: dotted path, the bad value, what is allowed."""
    loc = tuple(error["loc"])
    path = _dotted(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        model = _model_at(schema, loc[:-1])
        candidates = list(model.model_fields) if model is not None else []
        return _unknown_key([str(p) for p in loc], candidates)
    if kind == "missing":
        return f"{path}: required key is missing"
    where = f"{path}: " if path else ""
    message = error["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    value = error.get("input")
    got = "" if isinstance(value, dict) else f"got {_short_repr(value)}; "
    expected = (error.get("ctx") or {}).get("expected")
    if kind in ("literal_error", "enum") and expected:
        return f"{where}{got}allowed values: {expected}"
    return f"{where}{got}{message}"


def config_to_yaml(cfg: BaseModel | DictConfig | dict[str, Any]) -> str:
    """Block-style YAML of a resolved config, keys in declaration order."""
    if isinstance(cfg, BaseModel):
        data: Any = cfg.model_dump(mode="json")
    elif isinstance(cfg, DictConfig):
        data = OmegaConf.to_container(cfg, resolve=True)
    else:
        data = cfg
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
