"""Typed, documented, validated config fields: pydantic dataclasses whose errors name the key, the value given and
what is allowed (`ConfigError`).

A section of the run config (and `txl_dist.model.ModelConfig`) is declared once, its annotations, ``Field``
constraints and attribute docstrings being its types, ranges and documentation::

    @config_dataclass
    class LogConfig:
        SECTION: ClassVar[str] = "log"

        every: Positive = 100  # Annotated[int, Field(ge=1)]
        \"""Log training scalars every this many optimizer steps.\"""

pydantic checks every field when an instance is made, ``dataclasses.replace`` included, in strict mode: YAML's loose
spellings are refused (``'2'`` for an integer, ``'yes'`` for a boolean) except numbers written as strings, since PyYAML
reads ``1e-3`` as one (`Number`). Its ValidationError becomes a ConfigError whose "allowed" text is derived from the
field's type and constraints, or given by an `Allowed` marker where those would say it less well. Rules that join
fields are ``model_validator(mode="after")`` methods raising ConfigError themselves.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Literal, Union

import annotated_types
import pydantic
from pydantic import BeforeValidator, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic_core import ArgsKwargs


class ConfigError(ValueError):
    """A bad value in the run config; ``key`` is its full path (``train.micro_batch``)."""

    def __init__(self, key: str, value: Any, allowed: str, source: str | None = None) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        where = f" (set {source})" if source else ""
        super().__init__(f"{key}={value!r} is not allowed: {allowed}{where}")

    def with_source(self, source: str | None) -> ConfigError:
        return ConfigError(self.key, self.value, self.allowed, source)


class UnknownKeyError(ConfigError):
    """A key that is no field of its section: ``unknown key 'optim.learning_rate' in run.yaml; allowed keys in
    optim: name, lr, ...``. The one check of unknown keys is pydantic's (``extra="forbid"``); this is its message."""

    def __init__(self, key: str, allowed_keys: list[str], source: str | None = None) -> None:
        self.key, self.value, self.allowed_keys, self.source = key, None, list(allowed_keys), source
        section = key.rpartition(".")[0]
        self.allowed = f"allowed keys in {section}: {', '.join(self.allowed_keys)}"
        ValueError.__init__(self, f"unknown key {key!r} {source or ''}".rstrip() + f"; {self.allowed}")

    def with_source(self, source: str | None) -> UnknownKeyError:
        """``source``: where the key was set ("in run.yaml", "on the command line"), as the message says it."""
        return UnknownKeyError(self.key, self.allowed_keys, source)

    def allowing(self, *keys: str) -> UnknownKeyError:
        """The same error, ``keys`` (read before the section is made) listed first among the allowed ones."""
        return UnknownKeyError(self.key, [*keys, *self.allowed_keys], self.source)


class Allowed(str):
    """``Annotated`` metadata: what a field's range error says is allowed, where its constraints alone would say it
    less well (``Annotated[Number, Field(ge=0, lt=1), Allowed("a probability in [0, 1)")]``)."""


def _read_number(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _refuse_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean")
    return value


def _tuple_as_list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


Number = Annotated[float, BeforeValidator(_read_number)]
"""A finite float; an integer or a numeric string is read as one (a boolean is not)."""
NOT_A_BOOLEAN = BeforeValidator(_refuse_bool)
"""For ``Literal`` integers, which pydantic would match with a boolean (``True == 1`` in Python)."""
TUPLE_AS_LIST = BeforeValidator(_tuple_as_list)
"""For list fields given a tuple in Python."""

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The range of every integer field unless its own is narrower: the counts, sizes and positions of a run end up in
torch's and numpy's int64 (tensors, the data state, DeepSpeed's buffers and counters), which hold no more."""
Integer = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Positive = Annotated[int, Field(ge=1, le=INT64_MAX)]
NonNegative = Annotated[int, Field(ge=0, le=INT64_MAX)]
PositiveNumber = Annotated[Number, Field(gt=0)]
NonNegativeNumber = Annotated[Number, Field(ge=0.0)]
NonEmpty = Annotated[str, Field(min_length=1)]

CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True)

_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "string_too_short"}
_BOUND_OPS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_SCALAR_NAMES = {
    bool: ("a boolean (true or false)", "booleans"),
    int: ("an integer", "integers"),
    float: ("a finite number", "numbers"),
    str: ("a string (quote it if it looks like a number)", "strings"),
}


def config_dataclass(cls: type) -> type:
    """``cls`` as a pydantic dataclass (`CONFIG`) that raises `ConfigError` and has ``validate()``. Its keys are
    ``{cls.SECTION}.{field}``."""
    cls = pydantic.dataclasses.dataclass(cls, config=CONFIG)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _validate_into(self, args, kwargs, None)

    def validate(self: Any) -> Any:
        """Check the fields again (they may have been assigned since the instance was made); returns self."""
        dataclasses.replace(self)
        return self

    cls.__init__, cls.validate = __init__, validate
    return cls


def make_validated(cls: type, values: dict[str, Any], context: dict[str, Any] | None = None) -> Any:
    """``cls(**values)``, its validators given ``context`` (for rules that depend on how the values were given)."""
    instance = cls.__new__(cls)
    _validate_into(instance, (), values, context)
    return instance


def _validate_into(instance: Any, args: tuple, kwargs: dict[str, Any], context: dict[str, Any] | None) -> None:
    cls = type(instance)
    try:
        cls.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=instance, context=context)
    except pydantic.ValidationError as error:
        given = {**dict(zip([f.name for f in dataclasses.fields(cls)], args)), **kwargs}
        raise _config_error(cls, error, given) from None


def _config_error(cls: type, error: pydantic.ValidationError, given: dict[str, Any]) -> Exception:
    """The first of ``error``'s findings as a ConfigError: type errors first, as a reader fixes them first."""

    def is_type_error(detail: dict[str, Any]) -> bool:
        return detail["type"] not in _RANGE_ERRORS and not isinstance(detail.get("ctx", {}).get("error"), ConfigError)

    def rank(detail: dict[str, Any]) -> int:  # unknown keys first, then type errors, then the rest
        return 0 if detail["type"] == "unexpected_keyword_argument" else 1 if is_type_error(detail) else 2

    detail = sorted(error.errors(include_url=False), key=rank)[0]
    raised = detail.get("ctx", {}).get("error")
    if isinstance(raised, ConfigError):  # a rule that joins fields
        return raised
    name = detail["loc"][0] if detail["loc"] else None
    if isinstance(name, int):  # a positional argument
        name = list(cls.__pydantic_fields__)[name]
    if detail["type"] == "unexpected_keyword_argument":
        return UnknownKeyError(f"{cls.SECTION}.{name}", [f.name for f in dataclasses.fields(cls)])
    if name not in cls.__pydantic_fields__:
        return ValueError(f"{cls.__name__}: {detail['msg']}")
    field = cls.__pydantic_fields__[name]
    key = f"{cls.SECTION}.{name}"
    if detail["type"] in _RANGE_ERRORS and len(detail["loc"]) == 1:
        # pydantic reports the value given; the message names the value as the field holds it (1 -> 1.0)
        value = _read_number(detail["input"]) if _scalar(field.annotation) is float else detail["input"]
        return ConfigError(key, value, _range_text(field, value))
    if detail["type"] in _RANGE_ERRORS and len(detail["loc"]) == 2:  # an item of a list
        bound = ", ".join(f"{op} {detail['ctx'][name]}" for name, op in _BOUND_OPS.items() if name in detail["ctx"])
        return ConfigError(key, given.get(name, detail["input"]), f"{_type_text(field.annotation)}, each {bound}")
    return ConfigError(key, given.get(name, detail["input"]), _type_text(field.annotation))


def _range_text(field: FieldInfo, value: Any) -> str:
    """What a constraint allows, in the words of the config's messages (``a positive integer, or null``)."""
    optional = type(None) in typing.get_args(field.annotation)
    constraints = list(field.metadata)
    for arg in typing.get_args(field.annotation):  # an Optional's constraints are inside it
        if typing.get_origin(arg) is Annotated:
            constraints += [
                c for item in arg.__metadata__ for c in (item.metadata if isinstance(item, FieldInfo) else [item])
            ]
    for item in constraints:
        if isinstance(item, Allowed):
            return str(item)
    if isinstance(value, str):
        return "a non-empty string" + (" or null" if optional else "")
    bounds = {type(item): item for item in constraints if isinstance(item, annotated_types.BaseMetadata)}
    is_int = isinstance(value, int)
    low = bounds[annotated_types.Ge].ge if annotated_types.Ge in bounds else None
    if is_int and annotated_types.Le in bounds and (value > bounds[annotated_types.Le].le or low not in (0, 1)):
        text = _int_range_text(low, bounds[annotated_types.Le].le)
    elif annotated_types.Ge in bounds:
        ge = bounds[annotated_types.Ge].ge
        text = ("a positive integer" if ge == 1 else f"an integer >= {ge}") if is_int else f"a number >= {ge}"
    elif annotated_types.Gt in bounds:
        gt = bounds[annotated_types.Gt].gt
        text = "a positive number" if gt == 0 else f"a number > {gt}"
    else:
        raise TypeError(f"no message for the constraints {field.metadata} of a config field")
    return text + (", or null" if optional else "")


def _int_range_text(low: int, high: int) -> str:
    """``an integer from 1 to 9223372036854775807 (2**63 - 1, the largest int64)``."""
    if high == INT64_MAX:
        power = " (2**63 - 1, the largest int64)"
    elif high > 2**16 and (high + 1).bit_count() == 1:
        power = f" (2**{high.bit_length()} - 1)"
    elif high > 2**16 and high.bit_count() == 1:
        power = f" (2**{high.bit_length() - 1})"
    else:
        power = ""
    return f"an integer from {low} to {high}{power}"


def _scalar(hint: Any) -> Any:
    """The type of a field's value without Annotated and Optional (``float`` for ``Number | None``)."""
    while typing.get_origin(hint) in (Annotated, Union, types.UnionType):
        hint = [a for a in typing.get_args(hint) if a is not type(None)][0]
    return hint


def _type_text(hint: Any) -> str:
    """What a field's type allows (``a list of integers``, ``one of ['adamw', 'adam']``, ``an integer, or null``)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _type_text(args[0])
    if origin is list:
        return f"a list of {_SCALAR_NAMES[_scalar(args[0])][1]}"
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_type_text(inner)}, or null"
    if origin is Literal:
        return f"one of {list(args)}"
    return _SCALAR_NAMES[hint][0]
