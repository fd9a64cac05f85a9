"""Credit settings read from files: one check for every file that carries them.

A run's ``--config``, a saved ``--credit auto`` choice (``credit_choice.json``), the rows auto
reads (``measurements/credit_auto.json``) and the learn.json ``bench record-auto`` records all set
``credit.<field>`` values. One rule holds for all of them: a setting that names code to import or
a model to load (:data:`CODE_SETTINGS`) comes only from the command line, or from the ``--config``
file of a fresh run (announced in one line before anything is imported); a data file never names
code. A data file sets only plain, declared fields of the credit config's dataclasses, each a
value of its declared type, and the config those settings produce passes the config's own checks.
Every refusal is one ``UserError`` line naming the file (a ``--config`` file's part of the rule:
``config_io.config_file_code``). Torch-free at import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from rredcot.config import CODE_SETTINGS, CreditConfig
from rredcot.config.io import (
    brief,
    coerce_value,
    from_dict,
    merge_overrides,
    to_dict,
    type_hints,
)
from rredcot.errors import UserError

CODE_METHODS = ("process_reward",)
"""Methods that run the code or model :data:`CODE_SETTINGS` name: a data file never chooses one."""


@functools.cache
def credit_fields() -> dict[str, Any]:
    """Dotted name -> declared type of every plain field of ``CreditConfig`` and its sections."""

    def walk(cls: type, prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            hint = type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                out.update(walk(hint, f"{prefix}{f.name}."))
            else:
                out[f"{prefix}{f.name}"] = hint
        return out

    return walk(CreditConfig, "")


def plain_value(value: Any, hint: Any, name: str) -> Any:
    """``value`` checked against the declared type ``hint`` (bool, int, finite float, str, a
    mapping, ``X | None``, a tuple of them); a ``ValueError`` naming ``name`` otherwise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None and len(inner) < len(args):
            return None
        return plain_value(value, inner[0], name) if len(inner) == 1 else _refuse(name, value)
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ValueError(f"{name} must be a list of {len(args)} values, not {brief(value)}")
        return tuple(plain_value(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if hint is float and number:
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise ValueError(f"{name}={brief(value)}: give a finite number")
        return value
    kinds = {bool: bool, int: int, float: float, str: str, dict: Mapping}
    kind = kinds.get(origin if origin is dict else hint)
    if kind is None:
        _refuse(name, value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(
            f"{name} must be a plain value of type {getattr(hint, '__name__', hint)}, not a "
            f"{type(value).__name__} ({brief(value)})"
        )
    return dict(value) if kind is Mapping else value


def _refuse(name: str, value: Any) -> Any:
    raise ValueError(f"{name} is not a plain setting a file may give ({brief(value)})")


def check_credit_settings(
    settings: Any, where: str, fix: str, from_text: bool = False
) -> dict[str, Any]:
    """A data file's ``credit.<field>`` settings, checked: a mapping of declared plain fields,
    none of :data:`CODE_SETTINGS`, each a value of its declared type (``from_text``: a string is
    read as that type, as a flag's value). Returns them typed; else a ``UserError``."""
    if not isinstance(settings, Mapping):
        raise UserError(f"{where}: settings must be a mapping of credit.<field> values; {fix}")
    fields, out = credit_fields(), {}
    for key, value in settings.items():
        name = brief(str(key), 80, quote=False)
        if key in CODE_SETTINGS:
            raise UserError(
                f"{where}: settings name credit.{name}, which would load code or a model; a data "
                f"file never does: name it on the command line yourself (--credit.{name}) "
                f"after reading that file; {fix}"
            )
        if not isinstance(key, str) or key not in fields:
            raise UserError(f"{where}: credit.{name} is not a credit setting; {fix}")
        try:
            if from_text and isinstance(value, str):
                value = coerce_value(value, fields[key], f"credit.{key}")
            out[key] = plain_value(value, fields[key], f"credit.{key}")
        except ValueError as err:
            raise UserError(f"{where}: {err}; {fix}") from None
    return out


def check_data_method(method: Any, where: str, fix: str) -> str:
    """A credit method a data file names: registered, not ``auto``, and none of
    :data:`CODE_METHODS`; else a ``UserError``."""
    if not isinstance(method, str):
        raise UserError(f"{where}: method must be a credit method's name, not {brief(method)}")
    if method in CODE_METHODS:
        raise UserError(
            f"{where}: method {method!r} runs code or a model its settings name; a data file "
            f"never chooses it (name --credit {method} yourself); {fix}"
        )
    from rredcot.methods.base import get_credit  # lazy: it imports torch

    try:
        get_credit(method)
    except ValueError as err:
        raise UserError(f"{where}: {err}; {fix}") from None
    return method


def credit_config_with(settings: dict[str, Any], where: str, fix: str, base: Any = None) -> Any:
    """The ``CreditConfig`` that checked ``settings`` produce over ``base`` (default: the
    defaults), built as a config file's is (every section's checks and the combinations the
    config refuses); else a ``UserError``."""
    data = merge_overrides(to_dict(base if base is not None else CreditConfig()), settings)
    try:
        return from_dict(CreditConfig, data, "credit.")
    except (ValueError, TypeError) as err:
        raise UserError(f"{where}: {err}; {fix}") from None


def plain_fields(cls: type, data: Any, where: str, fix: str) -> dict[str, Any]:
    """The fields of dataclass ``cls`` a data file's object gives, checked: an object, only
    declared fields, none missing without a default, each of its declared type."""
    if not isinstance(data, Mapping):
        raise UserError(f"{where}: a row must be an object, not a {type(data).__name__}; {fix}")
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = sorted(brief(str(k), 40, quote=False) for k in data if k not in names)
    missing = sorted(
        f.name
        for f in fields
        if f.name not in data and f.default is dataclasses.MISSING
        if f.default_factory is dataclasses.MISSING
    )
    if unknown or missing:
        raise UserError(
            f"{where}: unknown fields {unknown[:5]} / missing fields {missing}; valid: "
            f"{sorted(names)}; {fix}"
        )
    hints = typing.get_type_hints(cls)
    try:
        return {k: plain_value(v, hints[k], k) for k, v in data.items()}
    except ValueError as err:
        raise UserError(f"{where}: {err}; {fix}") from None
