"""Configs in and out: a config dataclass <-> a nested dict <-> a YAML file <-> CLI flags.

The schema is ``rredcot.config`` (dataclasses whose fields carry their help text); this module
maps any such dataclass to flags and files and back, and resolves the config a command runs
with. Nested dataclasses become dotted flags (``--credit.lam 0.5``, ``--credit.value_head.lr
1e-3``); the same nesting is the YAML layout. ``--config FILE`` loads a YAML file first and flags
given on the command line override it; ``--task.KEY VALUE`` sets ``task_args``. Unknown keys are
errors that list the valid ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# yaml is imported where a file is read or written: building the CLI's flags needs none of it.
from rredcot.config import CODE_SETTINGS, RESUMABLE_FIELDS, TrainConfig
from rredcot.errors import UserError
from rredcot.safe_fs import read_yaml_file, write_text_atomic

# ---------------------------------------------------------------------------------------------
# dataclass <-> dict


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, evaluated once per class (flags, YAML and every dotted name
    read them; evaluating the string annotations each time made building the CLI slow)."""
    return typing.get_type_hints(cls)


def to_dict(cfg: Any) -> dict:
    """A plain nested dict of a config dataclass (for YAML and metrics)."""
    return dataclasses.asdict(cfg)


def brief(value: Any, limit: int = 60, quote: bool = True) -> str:
    """``value`` for an error message, cut to about ``limit`` characters: a message that quotes
    a file's content (a config.yaml linked to another file) never dumps it."""
    text = repr(value) if quote else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({type(value).__name__} of {len(str(value))} characters)"


def from_dict(cls: type, data: Mapping, where: str = "") -> Any:
    """Build dataclass ``cls`` from a nested mapping; unknown keys are errors that list the valid
    ones."""
    if not isinstance(data, Mapping):
        raise ValueError(
            f"config section {where or 'top level'} must be a mapping, got {brief(data)}"
        )
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            section = f" in {where.rstrip('.')}" if where else ""
            raise ValueError(
                f"unknown config key {where}{brief(key, quote=False)}; valid keys{section}: "
                f"{valid_keys(cls)}"
            )
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(hint, value or {}, where=f"{where}{key}.")
        else:
            kwargs[key] = coerce_value(value, hint, f"{where}{key}")
    return cls(**kwargs)


def coerce_value(value: Any, hint: Any, name: str) -> Any:
    """Convert a YAML or CLI value to the field's type, with an error that names the field."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
        # '' is no value only where the field is not text: `--resume ''` stays '' (and is refused
        # as naming no directory), never None (a fresh run in the default directory)
        blank = ("none", "null") if hint is str else ("none", "null", "")
        if value is None or (isinstance(value, str) and value.lower() in blank):
            return None
        origin = typing.get_origin(hint)
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if hint in (int, float, str):
            if hint is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return hint(value)
        if hint is dict or origin is dict:
            if isinstance(value, str):
                return json.loads(value)
            return dict(value)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{name}: cannot read {brief(value)} as {getattr(hint, '__name__', hint)}"
        ) from err
    return value


def valid_keys(cls: type) -> str:
    """The keys ``cls`` takes, for an error message: its fields, and a section's own fields as
    ``section.{a, b}`` (``section.*`` where it nests further)."""
    hints = type_hints(cls)
    names = []
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name):
        hint = hints[f.name]
        if not dataclasses.is_dataclass(hint):
            names.append(f.name)
        elif any(dataclasses.is_dataclass(h) for h in type_hints(hint).values()):
            names.append(f"{f.name}.*")
        else:
            inner = ", ".join(sorted(g.name for g in dataclasses.fields(hint)))
            names.append(f"{f.name}.{{{inner}}}")
    return ", ".join(names)


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted names of a nested config dict: ``{"credit.lam": 1.0, ...}`` (``task_args`` stays
    one value)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "task_args":
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def merge_overrides(base: dict, flat: dict[str, Any]) -> dict:
    """Apply dotted overrides ``{"credit.lam": "0.5"}`` to a nested dict."""
    out = json.loads(json.dumps(base))
    for dotted, value in flat.items():
        node = out
        *parents, leaf = dotted.split(".")
        for i, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                section = ".".join(parents[: i + 1])
                raise UserError(f"config section {section!r} must be a mapping, got {brief(node)}")
        node[leaf] = value
    return out


# ---------------------------------------------------------------------------------------------
# configs as YAML files (read and written through rredcot.safe_fs)


def load_yaml(path: str | Path, cls: type = TrainConfig, follow: bool = True) -> Any:
    """A config dataclass from a YAML file (see ``read_yaml_file`` for the errors)."""
    data = read_yaml_file(path, follow=follow)
    try:
        return from_dict(cls, data or {})
    except ValueError as err:
        raise UserError(f"{err} (in {path})") from None


def save_yaml(cfg: Any, path: str | Path) -> None:
    """Write ``cfg`` as YAML atomically: a reader (or a resumed run) never sees half a file."""
    import yaml  # CLI start-up, as read_yaml_file

    write_text_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


# ---------------------------------------------------------------------------------------------
# CLI flags


def add_dataclass_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    skip: tuple[str, ...] = (),
    group: Any = None,
) -> None:
    """Add one ``--prefix.field`` flag per field, also spelled with hyphens (``--eval-every`` for
    ``--eval_every``) and with any ``flags`` aliases the field's metadata names. A nested
    dataclass recurses into a help group of its own (``credit.value_head``, described by its
    docstring). Defaults are unset (``argparse.SUPPRESS``): only flags actually given
    override a YAML file or the dataclass's own defaults. ``skip``: fields set another way;
    ``group``: the help group of ``cls``'s own fields (default: the parser's options)."""
    target = parser if group is None else group
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            section = parser.add_argument_group(f"{prefix}{f.name}", dataclass_doc(hint))
            add_dataclass_flags(parser, hint, prefix=f"{prefix}{f.name}.", group=section)
            continue
        if f.name == "task_args" or f.name in skip:
            continue  # task_args: free-form --task.KEY VALUE, parsed separately
        default = f.default if f.default is not dataclasses.MISSING else "(computed)"
        text = f"{f.metadata.get('help', '')} (default: {default})"
        extra = {"nargs": "?", "const": "true"} if hint is bool else {}  # `--overwrite` alone
        target.add_argument(
            *_flag_names(prefix, f.name, f.metadata.get("flags", ())),
            dest=f"{prefix}{f.name}",
            default=argparse.SUPPRESS,
            metavar=_metavar(hint),
            help=text.replace("%", "%%"),  # argparse formats help with %
            **extra,
        )


def _flag_names(prefix: str, name: str, extra: tuple[str, ...] = ()) -> list[str]:
    names = [f"--{prefix}{name}"]
    if "_" in name:
        names.append(f"--{prefix}{name.replace('_', '-')}")
    return names + list(extra)


def dataclass_doc(cls: type) -> str | None:
    """The docstring of a config dataclass as one paragraph (None when it has none of its own)."""
    doc = cls.__doc__ or ""
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclass writes in for a missing one
        return None
    return " ".join(doc.split()) or None


def _metavar(hint: Any) -> str:
    args = typing.get_args(hint)
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    return getattr(base, "__name__", "VALUE").upper()


def split_task_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Pull ``--task.KEY VALUE`` (or ``--task.KEY=VALUE``) pairs out of argv."""
    rest, task_args = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--task."):
            key, eq, value = arg[len("--task.") :].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{arg} needs a value")
                value = argv[i + 1]
                i += 1
            task_args[key.replace("-", "_")] = value
        else:
            rest.append(arg)
        i += 1
    return rest, task_args


# ---------------------------------------------------------------------------------------------
# a run's config: --config, flags and --task.*, or --resume


def resolve_config(
    cls: type,
    yaml_path: str | None,
    overrides: dict[str, Any],
    task_args: dict[str, str] | None = None,
    log: Any = print,
) -> Any:
    """YAML file (if any), then CLI overrides, then ``--task.*`` arguments -> a validated config.
    Code or a model the file names (:func:`config_file_code`) is said in one line on a fresh run
    and refused on ``--resume`` unless a flag names it too."""
    base: dict = {}
    if yaml_path:
        base = read_yaml_file(yaml_path, "--config") or {}
        if not isinstance(base, dict):
            raise UserError(
                f"--config {yaml_path} holds a {type(base).__name__}, not a mapping of config "
                "fields (e.g. 'steps: 20')"
            )
        resuming = bool(overrides.get("resume") or base.get("resume"))
        config_file_code(yaml_path, base, overrides, resuming, log)
    merged = merge_overrides(base, overrides)
    if task_args:
        merged.setdefault("task_args", {}).update(task_args)
    return from_dict(cls, merged)


def given_fields(
    yaml_path: str | None, overrides: dict[str, Any], task_args: dict[str, str] | None = None
) -> set[str]:
    """Dotted names of the fields a command line sets: its flags, its ``--config`` file's keys and
    ``task_args`` for ``--task.*``."""
    given = set(overrides)
    if yaml_path:
        base = read_yaml_file(yaml_path, "--config") or {}
        if isinstance(base, dict):
            given |= set(flatten(base))
    if task_args:
        given.add("task_args")
    return given


def config_file_code(
    path: str, data: Any, flags: Mapping[str, Any], resuming: bool, log: Any = print
) -> None:
    """The code a ``--config`` file names (:data:`CODE_SETTINGS`): a fresh run takes it, said in
    one line now (before anything is imported); a resumed run takes it only from the command line
    (``flags``): the run's own ``config.yaml`` passed back as ``--config`` names nothing."""
    named = flatten(data) if isinstance(data, dict) else {}
    for key in CODE_SETTINGS:
        dotted, value = f"credit.{key}", named.get(f"credit.{key}")
        if not value or dotted in flags:
            continue
        said, flag = brief(value, 200), brief(value, 200, quote=False)
        if resuming:
            raise UserError(
                f"--config {path} names {dotted}={said}, which resuming would load; a resumed "
                "run loads code or a model only when named on the command line: read that "
                f"file, then give --{dotted} {flag} yourself"
            )
        log(f"rredcot: --config {path} names {dotted}={said}: this run will load it")


_INVOCATION_FIELDS = ("out", "resume", "overwrite")  # how a run is started, not what it is


def resume_config(cfg: TrainConfig, given: set[str] | None = None) -> TrainConfig:
    """The config of ``--resume RUN``: the run's ``config.yaml`` with the fields named in ``given``
    taken from ``cfg`` (``None``: the fields where ``cfg`` differs from the defaults). A given
    field outside ``RESUMABLE_FIELDS`` that changes the run is refused, every one named, and so
    is a process-reward function or model that the file names and ``given`` does not restate
    (reading a run never loads code it names)."""
    run = Path(cfg.resume or "")
    saved_path = run / "config.yaml"
    if not os.path.lexists(saved_path):
        raise FileNotFoundError(f"--resume {run}: no config.yaml there; is it a run directory?")
    saved = load_yaml(saved_path, follow=False)  # a link there is refused, never followed
    old = flatten(to_dict(saved))
    new = flatten(to_dict(cfg))
    if given is None:
        default = flatten(to_dict(TrainConfig()))
        given = {k for k, v in new.items() if v != default.get(k)}
    if cfg.overwrite:
        raise UserError(
            f"--resume {run} continues the run and --overwrite replaces it; give one of them"
        )
    if "out" in given and Path(cfg.out).resolve() != run.resolve():
        raise UserError(
            f"--out {cfg.out} and --resume {run} name different directories; a resumed run stays "
            "in its own directory: drop --out"
        )
    merged = dict(old)
    for name in given:
        if name in _INVOCATION_FIELDS or name not in new:
            continue
        if name == "task_args":
            merged[name] = {**old[name], **new[name]}
        else:
            merged[name] = new[name]

    def same(name: str) -> bool:
        if name == "task_args":  # CLI strings against the values a first run was given
            as_text = lambda d: {k: str(v) for k, v in d.items()}  # noqa: E731
            return as_text(merged[name]) == as_text(old[name])
        return merged[name] == old[name]

    for code in (f"credit.{key}" for key in CODE_SETTINGS):  # loaded only where restated
        if old.get(code) and code not in given:
            raise UserError(
                f"--resume {run}: its config.yaml names {code}={brief(old[code], 200)}, code or "
                "a model that resuming would load; read that file, then name it yourself to "
                f"allow it: --{code} {brief(old[code], 200, quote=False)}"
            )
    changed = sorted(n for n in merged if n not in RESUMABLE_FIELDS and not same(n))
    if changed:
        was = ", ".join(f"{n}={old[n]!r}" for n in changed)
        asked = ", ".join(f"{n}={merged[n]!r}" for n in changed)
        raise UserError(
            f"--resume {run}: the run was made with {was}; this command asks for {asked}. Only "
            f"{', '.join(RESUMABLE_FIELDS)} may change when resuming: drop the others, or start a "
            "new run (another --out, or --overwrite)"
        )
    nested: dict[str, Any] = {}
    merged.update(out=str(run), resume=str(run), overwrite=False)
    return from_dict(TrainConfig, merge_overrides(nested, merged))
