"""Named method variants for the benchmarks: ``name=method:key=value:key=value``.

A variant is a credit method plus config overrides, so that, say, the collapse configuration of
docs/method.md (failure modes) runs next to the default::

    --methods "uniform,value_head,vh_collapse=value_head:lam=0:separate_answer=true:handover.mode=off:value_head.shared_prefixes=false"

A preset of :data:`rredcot.methods.auto.PRESETS` (``cl_flow``, ``cl_cheap``) stands for its method
and settings (``uniform,cl_cheap``; ``cl_w2=cl_cheap:continuation_likelihood.window=2``).

Keys are fields of ``CreditConfig`` (``lam``, ``separate_answer``, ...) or of its sections
(``value_head.lr``, ``handover.mode``), dotted ``TrainConfig`` paths (``sampling.temperature``) or
top-level ``TrainConfig`` fields (``lr``). Without a name the variant is called by its whole
spec (``value_head:lam=0``), or by the method when there are no overrides. A segmenter with
options keeps them: ``vh_merge=value_head:segmenter=newline+merge:fraction=0.5:lam=0``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field

from rredcot.config import CreditConfig, TrainConfig
from rredcot.config.io import flatten, from_dict, merge_overrides, to_dict, valid_keys
from rredcot.methods.auto import PRESETS, check_method_name, preset_value

_NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass
class Variant:
    name: str
    method: str
    overrides: dict[str, str] = field(default_factory=dict)  # dotted TrainConfig keys

    def credit_config(self, base: dict[str, str] | None = None) -> CreditConfig:
        """``CreditConfig`` from ``base`` overrides (dotted, e.g. from ``--set``) and the
        variant's own (which win); non-credit keys are ignored here."""
        merged = {**(base or {}), **self.overrides}
        fields = {k[len("credit.") :]: v for k, v in merged.items() if k.startswith("credit.")}
        return from_dict(CreditConfig, merge_overrides({}, fields), where="credit.")

    def train_overrides(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Dotted ``TrainConfig`` overrides: ``base``, then the variant's, then its method."""
        return {**(base or {}), **self.overrides, "credit_method": self.method}


@functools.cache
def _train_paths() -> frozenset[str]:
    """Every dotted ``TrainConfig`` field name (``sampling.temperature``, ``model.lora_r``)."""
    return frozenset(flatten(to_dict(TrainConfig())))


def _dotted_key(key: str) -> str:
    """A variant's or ``--set``'s key as a dotted ``TrainConfig`` name: credit fields and
    sections (``lam``, ``value_head.lr``) get ``credit.``."""
    credit_fields = {f.name for f in dataclasses.fields(CreditConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    head = key.split(".", 1)[0]
    if head in credit_fields:
        return f"credit.{key}"
    if key in train_fields or key.startswith("task_args.") or key in _train_paths():
        return key
    raise ValueError(
        f"unknown variant key {key!r}; use a credit field ({valid_keys(CreditConfig)}), a "
        "top-level train field, or a dotted path like sampling.temperature"
    )


def parse_variant(spec: str, allow_auto: bool = False) -> Variant:
    """``[name=]method[:key=value...]`` -> :class:`Variant` (the method name is checked;
    ``auto``, which a training run resolves when it starts, only with ``allow_auto``)."""
    spec = spec.strip()
    if not spec:
        raise ValueError("empty method spec; give e.g. value_head or vh=value_head:lam=0")
    name = None
    head, eq, rest = spec.partition("=")
    if eq and ":" not in head:
        name, spec = head.strip(), rest.strip()
    method, *pairs = spec.split(":")
    method = method.strip()
    overrides: dict[str, str] = {}
    if method in PRESETS:  # a named preset: its method and settings, then the spec's own
        name = name or (spec if pairs else method)
        method, settings = PRESETS[method]
        overrides = {_dotted_key(k): preset_value(v) for k, v in settings.items()}
    check_method_name(method, allow_auto)  # raises with the valid names
    last = None
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"variant {spec!r}: {pair!r} is not key=value")
        try:
            dotted = _dotted_key(key.strip())
        except ValueError:
            if last != "credit.segmenter":
                raise
            # a segmenter's own options share the ':' (segmenter=newline+merge:target=4)
            overrides[last] = f"{overrides[last]}:{pair.strip()}"
            continue
        last = dotted
        overrides[dotted] = value.strip()
    name = name or (spec if overrides else method)
    if not _NAME_RE.match(name.replace(":", "+").replace("=", "-")) or set(name) <= {"."}:
        # '.' and '..' would name the runs folder itself or its parent
        raise ValueError(f"variant name {name!r}: use letters, digits, _ . + - (and not only dots)")
    variant = Variant(name, method, overrides)
    variant.credit_config()  # fail now on bad credit values
    return variant


def parse_variants(specs: str | list[str], allow_auto: bool = False) -> list[Variant]:
    """A comma-separated list (or a list) of specs; names must be unique (``allow_auto``: see
    :func:`parse_variant`)."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    variants = [parse_variant(s, allow_auto) for s in specs]
    names = [v.name for v in variants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(
            f"method variants named twice: {', '.join(dup)}; name them name=method:..."
        )
    if not variants:
        raise ValueError("no methods given; e.g. --methods uniform,value_head")
    return variants


def dir_name(name: str) -> str:
    """A directory-safe form of a variant name (never ``.`` or ``..``)."""
    safe = re.sub(r"[^A-Za-z0-9_.+-]", "-", name.replace(":", "+"))
    return safe if set(safe) - {"."} else safe.replace(".", "-")


def parse_set(pairs: list[str] | None) -> dict[str, str]:
    """``--set key=value`` pairs -> dotted overrides (bare credit fields get ``credit.``)."""
    out = {}
    for pair in pairs or []:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--set {pair!r}: use key=value, e.g. --set credit.lam=0.5")
        out[_dotted_key(key.strip())] = value.strip()
    return out
