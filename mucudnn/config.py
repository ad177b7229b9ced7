"""Network configs: the convolution layers of a network, read from YAML (docs/configs.md).

:func:`load_config` turns a YAML file (a path or a shipped name) into a :class:`NetworkConfig`; :meth:`NetworkConfig.kernels`
lists the kernels (one :class:`~mucudnn.problem.ConvProblem` per layer and direction) with how many
times each runs per training step. :func:`find_config` resolves a shipped config's name
(``resnet50``) or a path to a file; :func:`list_configs` names the shipped configs.

Every malformed config raises :class:`~mucudnn.errors.ConfigError` whose message names the file,
the line where known, the layer (1-based index and name) and the field, e.g.
``configs/x.yaml:9: layer 3 (conv2): field 'stride': expected 2 integers, got [1]``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import ConfigError
from .problem import ConvMode, ConvProblem, DataType, Direction, Layout, MathType

__all__ = ["ConfigLayer", "NetworkConfig", "find_config", "list_configs", "load_config"]

# Where shipped configs live: <repo>/configs in a source checkout (the source of truth), and
# mucudnn/data/configs in an installed package (a link to <repo>/configs in the checkout).
_PACKAGE_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _PACKAGE_DIR.parent
_PACKAGE_CONFIGS = _PACKAGE_DIR / "data" / "configs"
CONFIG_SUFFIX = ".yaml"

TOP_LEVEL_FIELDS = ("name", "source", "batch", "defaults", "layers")
KIND_FIELDS = ("dtype", "compute_type", "math", "layout", "mode")
DEFAULTABLE_FIELDS = (*KIND_FIELDS, "directions")
SPATIAL_FIELDS = ("in", "f", "pad", "stride", "dilation")
LAYER_FIELDS = ("name", "c", "k", *SPATIAL_FIELDS, "groups", "count", "batch",
                *DEFAULTABLE_FIELDS)
REQUIRED_LAYER_FIELDS = ("name", "c", "k", "in", "f")

_BUILTIN_DEFAULTS: dict[str, Any] = {
    "dtype": DataType.FLOAT,
    "math": MathType.FMA,
    "layout": Layout.NCHW,
    "mode": ConvMode.CROSS_CORRELATION,
    "directions": tuple(Direction),
}
_SPATIAL_DEFAULTS = {"pad": 0, "stride": 1, "dilation": 1}
_SPATIAL_MINIMUM = {"in": 1, "f": 1, "pad": 0, "stride": 1, "dilation": 1}


# -- the model ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ConfigLayer:
    """One convolution layer of a config, or ``count`` identical ones.

    ``problem`` is the forward geometry (its direction is always ``fwd``) with ``n`` = the layer's
    mini-batch; ``directions`` are the passes a training step runs for it, in canonical order.
    """

    name: str
    problem: ConvProblem
    count: int = 1
    directions: tuple[Direction, ...] = tuple(Direction)

    def problems(self) -> list[ConvProblem]:
        """The layer's kernels: its problem in each of its directions."""
        return [self.problem.with_direction(direction) for direction in self.directions]


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
    """The convolution layers of one network.

    ``batch`` is the config's top-level mini-batch size, or ``None`` when every layer carries its
    own (DeepBench); each layer's ``problem.n`` is the batch size that layer runs with.
    """

    name: str
    batch: int | None
    layers: tuple[ConfigLayer, ...]
    path: Path | None = None
    source: str = ""

    @property
    def layer_count(self) -> int:
        """How many convolution layers the network has, each repeat of a layer counted."""
        return sum(layer.count for layer in self.layers)

    def kernels(self) -> list[tuple[ConvProblem, int]]:
        """Every distinct kernel with its weight, in first-seen order.

        A kernel is a layer's problem in one direction; identical kernels (same key and N) from
        several layers are merged and their weight is the total count of those layers, i.e. how
        often the kernel runs in one training step.
        """
        weights: dict[ConvProblem, int] = {}
        for layer in self.layers:
            for problem in layer.problems():
                weights[problem] = weights.get(problem, 0) + layer.count
        return list(weights.items())

    def with_batch(self, batch: int) -> NetworkConfig:
        """The same network with every layer run at mini-batch size ``batch``."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        layers = tuple(dataclasses.replace(layer, problem=layer.problem.with_n(batch))
                       for layer in self.layers)
        return dataclasses.replace(self, batch=batch, layers=layers)


# -- finding configs ------------------------------------------------------------------------------

def _config_dirs() -> list[Path]:
    """Directories holding shipped configs, the source checkout's first."""
    dirs = []
    # Guarded by pyproject.toml so that an installed package never reads site-packages/configs.
    if (_REPO_ROOT / "pyproject.toml").is_file() and (_REPO_ROOT / "configs").is_dir():
        dirs.append(_REPO_ROOT / "configs")
    if _PACKAGE_CONFIGS.is_dir():
        dirs.append(_PACKAGE_CONFIGS)
    return dirs


def _shipped_configs() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for directory in _config_dirs():
        for path in sorted(directory.glob("*" + CONFIG_SUFFIX)):
            found.setdefault(path.stem, path)
    return found


def list_configs() -> list[str]:
    """Names of the shipped configs (``alexnet``, ``resnet50``, ...), sorted."""
    return sorted(_shipped_configs())


def find_config(name_or_path: str | Path) -> Path:
    """The file a user means: an existing file path as given, else a shipped config's name.

    ``resnet50`` and ``resnet50.yaml`` both name the shipped ResNet-50 config. Raises
    :class:`ConfigError` naming the shipped configs when neither matches.
    """
    candidate = Path(name_or_path)
    if candidate.is_file():
        return candidate
    shipped = _shipped_configs()
    name = candidate.name.removesuffix(CONFIG_SUFFIX)
    if candidate.name == str(name_or_path) and name in shipped:
        return shipped[name]
    raise ConfigError(f"no config {str(name_or_path)!r}: not a file, nor a shipped config "
                      f"(shipped: {', '.join(sorted(shipped)) or 'none'})")


# -- loading --------------------------------------------------------------------------------------

def load_config(name_or_path: str | Path) -> NetworkConfig:
    """Read and validate a config file, given as a path or a shipped config's name (see
    :func:`find_config`); :class:`ConfigError` says what is wrong."""
    path = find_config(name_or_path)
    document = _parse_yaml(_read_text(path), path)
    if document is None:
        raise ConfigError(f"{path}: the file is empty; expected a mapping with at least the "
                          "fields 'name' and 'layers'")
    return _build_config(document, path)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None


class _Mapping(dict):
    """A YAML mapping that remembers its own line and the line of each key (1-based)."""

    line: int = 0
    key_lines: dict[Any, int]


class _LineLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, except that mappings record lines and refuse duplicate keys."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> _Mapping:
    own_pairs = sum(1 for key_node, _ in node.value if key_node.tag != "tag:yaml.org,2002:merge")
    loader.flatten_mapping(node)  # puts the pairs of '<<' merge keys first, as SafeLoader does
    inherited_pairs = len(node.value) - own_pairs
    mapping = _Mapping()
    mapping.line = node.start_mark.line + 1
    mapping.key_lines = {}
    own_keys = set()
    for position, (key_node, value_node) in enumerate(node.value):
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain value", key_node.start_mark)
        if position >= inherited_pairs:  # a field written here may override a merged one
            if key in own_keys:
                # PyYAML would silently keep the last value: a repeated field is a typo.
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate field {key!r}", key_node.start_mark)
            own_keys.add(key)
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = key_node.start_mark.line + 1
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str, path: Path) -> Any:
    try:
        return yaml.load(text, Loader=_LineLoader)  # a SafeLoader subclass: as safe as safe_load
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        message = f"{where}: invalid YAML: {exc.problem or exc.context}"
        if exc.problem and exc.context:  # e.g. "while parsing a flow mapping" that began earlier
            started = f" that began at line {exc.context_mark.line + 1}" if exc.context_mark else ""
            message += f" ({exc.context}{started})"
        raise ConfigError(message) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None


class _Invalid(Exception):
    """A value is wrong; the caller adds the file, layer and field to the message."""


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where in a config a value sits, to prefix error messages."""

    path: Path
    section: str = ""  # "layer 3 (conv2)", "defaults" or "" for the top level

    def error(self, field: str | None, message: str, line: int = 0) -> ConfigError:
        parts = [f"{self.path}:{line}" if line else str(self.path)]
        if self.section:
            parts.append(self.section)
        if field is not None:
            parts.append(f"field {field!r}")
        parts.append(message)
        return ConfigError(": ".join(parts))


_MISSING = object()
T = TypeVar("T")


def _get(mapping: _Mapping, where: _Where, field: str, parse: Callable[[Any], T],
         default: Any = _MISSING) -> T:
    """``parse(mapping[field])``, or ``default`` when absent; errors name the field and its line."""
    if field not in mapping:
        if default is _MISSING:
            raise where.error(field, "missing (required)", mapping.line)
        return default
    try:
        return parse(mapping[field])
    except _Invalid as exc:
        raise where.error(field, str(exc), mapping.key_lines.get(field, mapping.line)) from None


def _check_fields(mapping: _Mapping, where: _Where, allowed: tuple[str, ...]) -> None:
    """Refuse fields not in ``allowed`` so that a misspelt field cannot pass silently."""
    for key in mapping:
        if key not in allowed:
            guess = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            raise where.error(str(key), f"unknown field{hint}; known fields: "
                              + ", ".join(allowed), mapping.key_lines.get(key, mapping.line))


def _build_config(document: Any, path: Path) -> NetworkConfig:
    where = _Where(path)
    if not isinstance(document, _Mapping):
        raise where.error(None, "expected a mapping with at least the fields 'name' and 'layers', "
                          f"got {_describe(document)}")
    _check_fields(document, where, TOP_LEVEL_FIELDS)
    name = _get(document, where, "name", _name)
    source = _get(document, where, "source", _text, "")
    batch = _get(document, where, "batch", _positive_integer, None)
    defaults = dict(_BUILTIN_DEFAULTS)
    if "defaults" in document:
        defaults.update(_parse_defaults(document, path))
    entries = _get(document, where, "layers", _non_empty_list)
    layers: list[ConfigLayer] = []
    first_index_of: dict[str, int] = {}
    for index, entry in enumerate(entries, start=1):
        layer = _build_layer(entry, index, path, defaults, batch, document.key_lines["layers"])
        if layer.name in first_index_of:
            raise _Where(path, f"layer {index} ({layer.name})").error(
                "name", f"duplicate layer name (layer {first_index_of[layer.name]} has it too)",
                _line_of(entry, "name"))
        first_index_of[layer.name] = index
        layers.append(layer)
    return NetworkConfig(name=name, batch=batch, layers=tuple(layers), path=path, source=source)


def _parse_defaults(document: _Mapping, path: Path) -> dict[str, Any]:
    where = _Where(path, "defaults")
    section = document["defaults"]
    if not isinstance(section, _Mapping):
        raise _Where(path).error("defaults", f"expected a mapping, got {_describe(section)}",
                                 document.key_lines["defaults"])
    _check_fields(section, where, DEFAULTABLE_FIELDS)
    return {field: _get(section, where, field, _DEFAULTABLE_PARSERS[field])
            for field in DEFAULTABLE_FIELDS if field in section}


def _build_layer(entry: Any, index: int, path: Path, defaults: dict[str, Any],
                 config_batch: int | None, layers_line: int) -> ConfigLayer:
    """Layer ``index`` (1-based) of the config; ``layers_line`` locates entries that are no mapping."""
    if not isinstance(entry, _Mapping):
        raise _Where(path, f"layer {index}").error(
            None, f"expected a mapping of fields, got {_describe(entry)}", layers_line)
    name = _get(entry, _Where(path, f"layer {index}"), "name", _name)
    where = _Where(path, f"layer {index} ({name})")
    _check_fields(entry, where, LAYER_FIELDS)
    for field in REQUIRED_LAYER_FIELDS:
        if field not in entry:
            raise where.error(field, "missing (required)", entry.line)
    batch = _get(entry, where, "batch", _positive_integer, config_batch)
    if batch is None:
        raise where.error("batch", "missing: give the layer a 'batch' or the config a top-level "
                          "'batch'", entry.line)
    problem = ConvProblem(direction=Direction.FORWARD, n=batch, **_parse_geometry(entry, where),
                          **_parse_kind(entry, where, defaults))
    directions = _get(entry, where, "directions", _directions, defaults["directions"])
    count = _get(entry, where, "count", _positive_integer, 1)
    return ConfigLayer(name=name, problem=problem, count=count, directions=directions)


def _parse_geometry(entry: _Mapping, where: _Where) -> dict[str, Any]:
    """The layer's shape fields as :class:`ConvProblem` arguments, checked for consistency."""
    dims = _get(entry, where, "in", _spatial_dims)
    spatial = {}
    for field in SPATIAL_FIELDS:
        default = (_SPATIAL_DEFAULTS[field],) * dims if field in _SPATIAL_DEFAULTS else _MISSING
        spatial[field] = _get(entry, where, field, _spatial(dims, _SPATIAL_MINIMUM[field]),
                              default)
    c = _get(entry, where, "c", _positive_integer)
    k = _get(entry, where, "k", _positive_integer)
    groups = _get(entry, where, "groups", _positive_integer, 1)
    if c % groups or k % groups:
        raise where.error("groups", f"c={c} and k={k} must both be multiples of groups={groups}",
                          _line_of(entry, "groups"))
    _check_output_not_empty(entry, where, spatial)
    return {"c": c, "k": k, "groups": groups, "input_size": spatial["in"],
            "filter_size": spatial["f"], "padding": spatial["pad"], "stride": spatial["stride"],
            "dilation": spatial["dilation"]}


def _parse_kind(entry: _Mapping, where: _Where, defaults: dict[str, Any]) -> dict[str, Any]:
    """The layer's data type, compute type, math, layout and mode as :class:`ConvProblem`
    arguments: the layer's own, else the defaults."""
    kind = {field: _get(entry, where, field, _DEFAULTABLE_PARSERS[field], defaults.get(field))
            for field in KIND_FIELDS}
    if kind["compute_type"] is None:
        kind["compute_type"] = _default_compute_type(kind["dtype"])
    return kind


def _default_compute_type(dtype: DataType) -> DataType:
    """f64 data computes in f64, all else in f32 (for f16 what PyTorch sets, and cuDNN's
    PSEUDO_HALF / PSEUDO_BFLOAT16 configurations)."""
    return DataType.DOUBLE if dtype is DataType.DOUBLE else DataType.FLOAT


def _check_output_not_empty(entry: _Mapping, where: _Where,
                            spatial: dict[str, tuple[int, ...]]) -> None:
    """The dilated filter must fit in the padded input, or the convolution has no output."""
    extent = [d * (f - 1) + 1 for f, d in zip(spatial["f"], spatial["dilation"])]
    padded = [i + 2 * p for i, p in zip(spatial["in"], spatial["pad"])]
    if any(e > p for e, p in zip(extent, padded)):
        raise where.error("f", f"the filter (dilated extent {_join(extent)}) is larger than the "
                          f"padded input ({_join(padded)}): the output would be empty",
                          _line_of(entry, "f"))


def _line_of(mapping: _Mapping, field: str) -> int:
    return mapping.key_lines.get(field, mapping.line)


def _join(values: list[int]) -> str:
    return "x".join(str(v) for v in values)


# -- value parsers: each returns the parsed value or raises _Invalid --------------------------------

_KIND_OF_VALUE = {bool: "boolean", int: "integer", float: "number", str: "text"}


def _describe(value: Any) -> str:
    """A short description of a YAML value for error messages: ``text '3'``, ``a list [1]``."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return f"a list {value!r}" if len(value) <= 8 else f"a list of {len(value)} items"
    return f"{_KIND_OF_VALUE.get(type(value), type(value).__name__)} {value!r}"


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML 'true' is not a size


def _positive_integer(value: Any) -> int:
    if not _is_integer(value):
        raise _Invalid(f"expected an integer, got {_describe(value)}")
    if value < 1:
        raise _Invalid(f"expected an integer >= 1, got {value}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"expected text, got {_describe(value)}")
    return value


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Invalid(f"expected a non-empty string, got {_describe(value)}")
    return value


def _non_empty_list(value: Any) -> list:
    if not isinstance(value, list) or not value:
        raise _Invalid(f"expected a non-empty list, got {_describe(value)}")
    return value


def _spatial_dims(value: Any) -> int:
    """Spatial dimensions the ``in`` field implies: its length, or 2 for a scalar."""
    if isinstance(value, list) and len(value) in (2, 3):
        return len(value)
    if _is_integer(value):
        return 2
    raise _Invalid(f"expected an integer or a list of 2 (H, W) or 3 (D, H, W) integers, "
                   f"got {_describe(value)}")


def _spatial(dims: int, minimum: int) -> Callable[[Any], tuple[int, ...]]:
    """Parser of one value per spatial dim; a scalar stands for the same value in each dim."""

    def parse(value: Any) -> tuple[int, ...]:
        values = [value] * dims if _is_integer(value) else value
        if not isinstance(values, list) or len(values) != dims \
                or not all(_is_integer(v) for v in values):
            raise _Invalid(f"expected {dims} integers (or one for all), got {value!r}")
        if any(v < minimum for v in values):
            raise _Invalid(f"expected integers >= {minimum}, got {value!r}")
        return tuple(values)

    return parse


E = TypeVar("E", bound=enum.Enum)


def _enum(enum_type: type[E]) -> Callable[[Any], E]:
    def parse(value: Any) -> E:
        try:
            return enum_type(value)
        except ValueError:
            choices = ", ".join(member.value for member in enum_type)
            raise _Invalid(f"expected one of {choices}, got {value!r}") from None

    return parse


def _directions(value: Any) -> tuple[Direction, ...]:
    if not isinstance(value, list) or not value:
        raise _Invalid(f"expected a non-empty list of directions, got {_describe(value)}")
    given = [_enum(Direction)(item) for item in value]
    if len(set(given)) != len(given):
        raise _Invalid(f"a direction is listed twice in {value!r}")
    return tuple(direction for direction in Direction if direction in given)


_DEFAULTABLE_PARSERS: dict[str, Callable[[Any], Any]] = {
    "dtype": _enum(DataType),
    "compute_type": _enum(DataType),
    "math": _enum(MathType),
    "layout": _enum(Layout),
    "mode": _enum(ConvMode),
    "directions": _directions,
}
