"""LoRA adapters (multi-LoRA serving): what a request runs with, and the one check of an
adapter folder. Torch-free: the router validates adapters here at load, the worker calls the
same check before it reads the weights.

An adapter is a PEFT folder: ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors`` whose tensors are
named ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``, with
``lora_A`` ``[r, in_features]`` and ``lora_B`` ``[out_features, r]`` (PEFT's layout).
``check_adapter`` reads the config and the safetensors header only (8-byte little-endian
length, then that many bytes of JSON), never the weights.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The projections an adapter may target (Llama-family names): attention q/k/v/o, the MLP.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_WEIGHT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}  # safetensors dtype -> bytes per element
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
_MAX_CONFIG_BYTES = 1024 * 1024  # adapter_config.json (a real one is ~1 KB)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# adapter_config.json fields that change what PEFT computes in ways served LoRA does not: each
# refused when set (truthy), with what it means
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "a bias on lora_B",
                "alora_invocation_tokens": "activated LoRA (aLoRA)",
                "layer_replication": "layer replication",
                "trainable_token_indices": "trained token embeddings",
                "target_parameters": "LoRA on parameters (target_parameters)",
                "use_qalora": "QALoRA", "fan_in_fan_out": "fan_in_fan_out weights"}
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.default)?\.weight")


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's LoRARequest): a router-unique id (>= 1; 0 is
    never used: no adapter), its name, and the PEFT folder the worker loads it from."""
    lora_id: int
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What ``check_adapter`` learned of a valid adapter.

    Attributes:
        rank: the largest rank ``r`` of its modules (``rank_pattern`` included).
        lora_alpha: PEFT's ``lora_alpha`` (the update is scaled by ``lora_alpha / r``, or
            ``lora_alpha / sqrt(r)`` with ``use_rslora``).
        use_rslora: rank-stabilized scaling.
        target_modules: the projections its tensors adapt, sorted (names of ``LORA_MODULES``).
        base_model_name_or_path: the base model it was trained on, as its config says ("").
    """

    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    base_model_name_or_path: str


class AdapterError(ValueError):
    """An adapter folder that cannot be served; the message names the problem."""


def _shapes(config: dict) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layer count, module -> (in_features, out_features)) of a transformers config dict."""
    config = config.get("text_config", config)
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
        layers = int(config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise AdapterError(f"the model's config lacks {e} (cannot check an adapter)") from None
    q, kv = heads * head_dim, kv_heads * head_dim
    return layers, {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                    "o_proj": (q, hidden), "gate_proj": (hidden, inter),
                    "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}
    (plus ``__metadata__``), without reading the tensors.

    Raises:
        AdapterError: not a safetensors file (a short file, a header length past its end, a
            header that is not a JSON object, data offsets past the end of the file).
    """
    size = _regular_file(path).st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterError(f"{path.name} is not a safetensors file: {size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise AdapterError(f"{path.name} is not a safetensors file: header length {n} but "
                               f"the file has {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise AdapterError(f"{path.name} is not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path.name} is not a safetensors file: the header is not a JSON "
                           "object")
    end = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]
                and offsets[1] <= end):
            raise AdapterError(f"{path.name} is not a safetensors file: tensor {name} lies "
                               "past the end of the file")
        shape, itemsize = t.get("shape"), _WEIGHT_DTYPES.get(t.get("dtype"))
        if (itemsize is not None and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
                and math.prod(shape) * itemsize != offsets[1] - offsets[0]):
            raise AdapterError(f"{path.name} is not a safetensors file: tensor {name} "
                               f"({t.get('dtype')} {shape}) has {offsets[1] - offsets[0]} "
                               "bytes of data")
    return header


def _regular_file(path: Path) -> os.stat_result:
    """``path``'s stat (symlinks followed), refusing what is not a regular file (a device such
    as /dev/zero or a FIFO would make a read endless or block it).

    Raises:
        AdapterError: missing (FileNotFoundError's message) or not a regular file.
    """
    try:
        st = path.stat()
    except OSError as e:
        raise AdapterError(f"{path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise AdapterError(f"{path} is not a regular file")
    return st


def read_config(folder: Path) -> dict:
    """``folder``'s ``adapter_config.json`` as a dict, refusing what served LoRA cannot run.

    Raises:
        AdapterError: missing, not a regular file, over 1 MiB, not a JSON object, not LoRA,
            or a field that changes what PEFT computes (DoRA, biases, aLoRA, ...: naming it).
    """
    path = folder / ADAPTER_CONFIG
    if not path.exists():
        raise AdapterError(f"{folder}: missing {ADAPTER_CONFIG}")
    if _regular_file(path).st_size > _MAX_CONFIG_BYTES:
        raise AdapterError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        with path.open("rb") as f:  # (bounded: the file may grow after the stat)
            config = json.loads(f.read(_MAX_CONFIG_BYTES + 1).decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{folder}: peft_type {kind!r} is not supported (only LORA)")
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError(f"{folder}: bias={config['bias']!r} is not supported (only 'none')")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"{folder}: {key}={config[key]!r} ({what}) is not supported")
    for key in ("r", "lora_alpha"):
        if key in config and not _is_number(config[key]):
            raise AdapterError(f"{folder}: {key} {config[key]!r} is not a number")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(_is_number(v) for v in patterns.values()):
            raise AdapterError(f"{folder}: {key} {patterns!r} is not a map of name patterns "
                               "to numbers")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise AdapterError(f"{folder}: {key} key {pattern!r} is not a regular "
                                   f"expression: {e}") from None
    if config.get("modules_to_save"):
        raise AdapterError(f"{folder}: modules_to_save {config['modules_to_save']} is not "
                           "supported (only LoRA updates of " + ", ".join(LORA_MODULES) + ")")
    return config


def _check_base(config: dict, model_config: dict, folder: Path) -> None:
    """A base_model_name_or_path that is a local model folder must describe the same model
    (where it is a hub id or absent, this cannot be decided here: the shapes check stands)."""
    base = config.get("base_model_name_or_path") or ""
    base_config = Path(base) / "config.json" if base else None
    if (base_config is None or not base_config.is_file()
            or base_config.stat().st_size > _MAX_CONFIG_BYTES):
        return
    try:
        theirs = json.loads(base_config.read_text())
    except (ValueError, OSError):
        return
    ours = model_config.get("text_config", model_config)
    theirs = theirs.get("text_config", theirs)
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size"):
        if key in ours and key in theirs and ours[key] != theirs[key]:
            raise AdapterError(f"{folder}: base model mismatch: the adapter was trained on "
                               f"{base} ({key}={theirs[key]}), the served model has "
                               f"{key}={ours[key]}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value)


def pattern_value(patterns: dict | None, layer: int, target: str, default: float) -> float:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` rule for one module: the value of the first
    key that matches the end of its name (``model.layers.{layer}.{self_attn|mlp}.{target}``),
    else ``default``."""
    part = "self_attn" if target in ATTENTION_TARGETS else "mlp"
    name = f"model.layers.{layer}.{part}.{target}"
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return float(value)
    return default


def check_adapter(path: str, model_config: dict, max_lora_rank: int) -> AdapterInfo:
    """Check that the PEFT folder ``path`` is a LoRA adapter this model can serve.

    Args:
        path: the adapter folder.
        model_config: the base model's transformers config (``config.json`` as a dict;
            ``model_config_of`` makes one for a GGUF file).
        max_lora_rank: the largest rank served (``--max-lora-rank``).

    Returns:
        The adapter's rank, scaling and target modules.

    Raises:
        AdapterError: naming the problem: a missing folder or file, a config that is not
            LoRA (or uses DoRA, a bias, modules_to_save), a rank above ``max_lora_rank``, a
            target module the model lacks (or a layer past its last), a tensor whose shape
            does not fit the base model (hidden size, head dims, intermediate size) or whose
            dtype is not a float, no LoRA tensor at all, a base model that is decidably
            another.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"{path}: no such adapter folder")
    config = read_config(folder)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.exists():
        raise AdapterError(f"{folder}: missing {ADAPTER_WEIGHTS}")
    _check_base(config, model_config, folder)
    num_layers, shapes = _shapes(model_config)
    targets = config.get("target_modules")
    for module in targets if isinstance(targets, list) else ():
        if module not in shapes:
            raise _lacks(folder, module)
    ranks: dict[str, int] = {}  # module kind -> largest rank
    for (layer, module), ab in sorted(_lora_tensors(folder, shapes, num_layers).items()):
        rank = _pair_rank(folder, config, layer, module, ab, shapes[module], max_lora_rank)
        ranks[module] = max(ranks.get(module, 0), rank)
    return AdapterInfo(rank=max(ranks.values()), lora_alpha=float(config.get("lora_alpha", 8)),
                       use_rslora=bool(config.get("use_rslora", False)),
                       target_modules=tuple(sorted(ranks)),
                       base_model_name_or_path=str(config.get("base_model_name_or_path") or ""))


def _lacks(folder: Path, module: str, tensor: str = "") -> AdapterError:
    """The error of a target module the model lacks (named by ``tensor``, if one)."""
    of = f" (tensor {tensor})" if tensor else ""
    return AdapterError(f"{folder}: target module {module!r}{of} is one the model lacks "
                        f"(it has {', '.join(LORA_MODULES)})")


def _lora_tensors(folder: Path, shapes: dict[str, tuple[int, int]], num_layers: int
                  ) -> dict[tuple[int, str], dict[str, list[int]]]:
    """The shapes of the adapter's LoRA tensors (its safetensors header, nothing loaded):
    ``{(layer, module): {"A": shape, "B": shape}}``, each checked to be a float LoRA A/B
    weight of a module and layer the model has.

    Raises:
        AdapterError: another tensor, a module the model lacks, a layer past its last, a
            dtype that is not a float, no LoRA tensor at all.
    """
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for name, t in read_safetensors_header(folder / ADAPTER_WEIGHTS).items():
        if name == "__metadata__":
            continue
        m = _KEY.fullmatch(name)
        if m is None:
            other = re.search(r"\.(\w+)\.lora_[AB]\.", name)
            if other is not None:
                raise _lacks(folder, other[1], name)
            raise AdapterError(f"{folder}: tensor {name} is not a LoRA A/B weight of a decoder "
                               "layer's projection (embedding, lm_head and bias tensors are not "
                               "supported)")
        layer, module, ab = int(m[1]), m[2], m[3]
        if module not in shapes:
            raise _lacks(folder, module)
        if layer >= num_layers:
            raise AdapterError(f"{folder}: tensor {name} is for layer {layer} but the model has "
                               f"{num_layers} layers")
        if t.get("dtype") not in _WEIGHT_DTYPES:
            raise AdapterError(f"{folder}: tensor {name} has dtype {t.get('dtype')}, not one of "
                               f"{', '.join(_WEIGHT_DTYPES)}")
        pairs.setdefault((layer, module), {})[ab] = list(t.get("shape", ()))
    if not pairs:
        raise AdapterError(f"{folder}: {ADAPTER_WEIGHTS} has no LoRA tensor")
    return pairs


def _pair_rank(folder: Path, config: dict, layer: int, module: str, ab: dict[str, list[int]],
               shape: tuple[int, int], max_lora_rank: int) -> int:
    """The rank r of one module's lora_A ``[r, in]`` and lora_B ``[out, r]``, checked against
    the base module's ``shape`` (in, out), the config's r / rank_pattern and
    ``max_lora_rank``.

    Raises:
        AdapterError: a tensor without its pair, shapes that are not of one rank or do not
            fit the module, a rank other than the config's or above ``max_lora_rank``.
    """
    where = f"layer {layer} {module}"
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{folder}: {where} has lora_{''.join(ab)} without its pair")
    (a, b), (d_in, d_out) = (ab["A"], ab["B"]), shape
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        raise AdapterError(f"{folder}: {where}: lora_A {a} and lora_B {b} are not "
                           "[r, in] and [out, r] of one rank r")
    if a[1] != d_in or b[0] != d_out:
        raise AdapterError(f"{folder}: {where}: shapes lora_A {a}, lora_B {b} do not fit "
                           f"the base model's {module} ({d_in} in, {d_out} out; hidden "
                           "size, head dims or intermediate size differ)")
    want = pattern_value(config.get("rank_pattern"), layer, module, config.get("r", 8))
    if a[0] != want:
        raise AdapterError(f"{folder}: {where}: lora_A {a} has rank {a[0]}, "
                           f"{ADAPTER_CONFIG} says r={want:g} (r / rank_pattern)")
    if a[0] > max_lora_rank:
        raise AdapterError(f"{folder}: rank {a[0]} ({where}) is above --max-lora-rank "
                           f"{max_lora_rank}")
    return a[0]


# GGUF metadata keys (after "<architecture>.") of the config fields check_adapter uses
_GGUF_KEYS = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
              "num_attention_heads": "attention.head_count",
              "num_key_value_heads": "attention.head_count_kv",
              "intermediate_size": "feed_forward_length", "head_dim": "attention.key_length"}


def model_config_of(model_path: str, is_gguf: bool) -> dict:
    """The base model's config as a dict: its folder's ``config.json``, or for a GGUF file the
    fields ``check_adapter`` needs, from the file's metadata (the ``gguf`` package, no torch).

    Raises:
        OSError: the file cannot be read. ValueError: not JSON / not a GGUF file.
    """
    if not is_gguf:
        return json.loads(Path(model_path, "config.json").read_text())
    import gguf  # (numpy only)

    fields = gguf.GGUFReader(model_path).fields
    arch = fields["general.architecture"].contents()
    config: dict = {"model_type": arch}
    for key, suffix in _GGUF_KEYS.items():
        field = fields.get(f"{arch}.{suffix}")
        if field is not None:
            config[key] = int(field.contents())
    return config
