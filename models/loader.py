"""Load local checkpoints: Hugging Face folders (config.json + safetensors, sharded or
not) and GGUF files (a ``.gguf`` file, or a folder holding one).

Nothing is downloaded: ``path`` must exist on disk.
"""

from __future__ import annotations

import json
import logging
import os

import jax.numpy as jnp
import numpy as np

from . import registry
from .config import ModelConfig
from .interface import CausalLM
from .moe import split_fused_experts
from .quant_format import Packed
from .quantize import check_quantization, pack_model, packed_targets
from .registry import abstract_model
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger("jax_kvcached.models")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read (truncated, corrupted, inconsistent); the
    message names the file."""


def _tensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: "
                                  f"{e})") from e  # fmt: skip
        files = [os.path.join(path, str(n)) for n in names]
        for file in files:
            if not os.path.isfile(file):
                raise CheckpointError(f"{file}: listed in {index} but missing")
        return files
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    for file in _tensor_files(path):
        try:  # safetensors checks the header against the file's size and names no file
            with safe_open(file, framework="flax") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{file}: not a readable safetensors file (truncated or "
                                  f"corrupted? {type(e).__name__}: {e})") from e  # fmt: skip
    return out


def load_checkpoint(
    path: str, *, dtype=None, quantization: str | None = None
) -> tuple[ModelConfig, CausalLM]:
    """Reads a checkpoint into a CausalLM.

    ``path``: a Hugging Face folder (config.json + safetensors; default dtype float32) or
    a GGUF file / a folder with one (default dtype bfloat16). ``quantization``: see
    :mod:`.quantize` (None: a quantized GGUF's weights stay packed; ``"none"``:
    dequantized; ``"int8"`` / ``"int4"``: packed at load).
    """
    from .gguf import GGUFCheckpoint, gguf_file

    check_quantization(quantization)
    gguf = gguf_file(path)
    if gguf is not None:
        return load_gguf(GGUFCheckpoint(gguf), dtype=dtype, quantization=quantization)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r}: no such folder or .gguf file")
    cfg = ModelConfig.from_dir(path)
    model = abstract_model(cfg, dtype=dtype or jnp.float32)
    tensors = _read_tensors(path)
    with open(os.path.join(path, "config.json")) as f:
        qcfg = json.load(f).get("quantization_config")
    if qcfg and str(qcfg.get("quant_method", "")).lower() == "mxfp4":
        qcfg = None  # GPT-OSS's MXFP4 experts: dequantized with the experts (moe.py)
    if qcfg:  # AWQ / GPTQ / compressed-tensors: packed as stored (models/hf_quant.py)
        from .hf_quant import read_quantized

        read_quantized(tensors, qcfg, path)
        if quantization == "none":
            tensors = {k: v.dequantize() if isinstance(v, Packed) else v
                       for k, v in tensors.items()}  # fmt: skip
    _assign(model, cfg, tensors, path, quantization)
    return cfg, model


def load_gguf(ck, *, dtype=None, quantization: str | None = None) -> tuple[ModelConfig, CausalLM]:
    """The model of an opened :class:`GGUFCheckpoint` (default dtype bfloat16); its
    quantized weights stay packed unless ``quantization`` says otherwise."""
    check_quantization(quantization)
    cfg = ck.config()
    model = abstract_model(cfg, dtype=dtype or jnp.bfloat16)
    _assign(model, cfg, ck.tensors(cfg, packed=quantization != "none"), ck.path, quantization)
    return cfg, model


def _assign(
    model: CausalLM, cfg: ModelConfig, tensors: dict, path: str, quantization: str | None = None
) -> None:
    """Copies HF-named tensors into the model, checking names and shapes; packed ones
    into the packed layers :func:`.quantize.pack_model` puts in."""
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store it anyway
    # Rotary caches some exporters save are derived, not weights.
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    prepare = registry.family(cfg.model_type).prepare_tensors
    if prepare is not None:  # the family's own checkpoint layout
        prepare(tensors, path)
    split_fused_experts(tensors)  # transformers 5's fused experts: per expert, as on the Hub
    pack_model(model, tensors, quantization, path)
    targets = model.hf_weights()
    missing = sorted(set(targets) - set(tensors))
    unexpected = sorted(set(tensors) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path!r} does not match a {cfg.model_type} model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    targets = packed_targets(targets, tensors, path)  # a packed weight: one entry per array
    stacked: dict[int, tuple[object, np.ndarray]] = {}  # id(param) -> (param, host rows)
    for name, (module, attr, transpose, index) in targets.items():
        value = tensors.pop(name)  # (released as it is copied)
        if transpose:
            value = value.T
        param = getattr(module, attr)
        current = param.get_value()  # an array, or a shape-only struct (abstract model)
        want = current.shape if index is None else _shape_at(current.shape, index)
        if value.shape != want:
            raise ValueError(f"{path}: {name}: shape {value.shape} != model's {want}")
        if index is None:
            param.set_value(jnp.asarray(value, dtype=current.dtype))
            continue
        if id(param) not in stacked:  # a stacked parameter: its layers' rows on the host
            stacked[id(param)] = (param, np.empty(current.shape, np.dtype(current.dtype)))
        stacked[id(param)][1][index] = np.asarray(value).astype(np.dtype(current.dtype))
    for param, rows in stacked.values():
        param.set_value(jnp.asarray(rows))


def _shape_at(shape: tuple[int, ...], index: int | tuple) -> tuple[int, ...]:
    """The shape of ``array[index]`` for an array of ``shape`` (an int: a layer of a
    stacked parameter; a tuple: e.g. one expert's half of a fused weight)."""
    return np.broadcast_to(np.empty((), np.int8), shape)[index].shape


def repack(model: CausalLM, cfg: ModelConfig, quantization: str | None) -> CausalLM:
    """``model`` (full precision, e.g. a random preset) rebuilt with its weights packed
    as ``quantization`` says (None / ``"none"``: returned as is)."""
    check_quantization(quantization)
    if quantization in (None, "none"):
        return model
    tensors = {}
    for name, (module, attr, transpose, index) in model.hf_weights().items():
        value = np.asarray(getattr(module, attr).get_value())
        value = value if index is None else value[index]
        tensors[name] = value.T if transpose else value
    fresh = abstract_model(cfg, dtype=model.dtype)
    _assign(fresh, cfg, tensors, "", quantization)
    return fresh


def find_chat_template(path: str | None) -> tuple[str | None, dict[str, str]]:
    """A checkpoint's chat template and the special tokens it may use, looked up in
    ``chat_template.jinja`` (transformers 5), ``tokenizer_config.json``, then GGUF
    metadata. ``(None, {})`` when it has none."""
    from .gguf import GGUFCheckpoint, gguf_file

    if not path:
        return None, {}
    gguf = gguf_file(path)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    cfg: dict = {}
    tc = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(tc):
        with open(tc, encoding="utf-8") as f:
            cfg = json.load(f)
    special = {
        k: v if isinstance(v, str) else (v or {}).get("content", "")
        for k, v in cfg.items()
        if k in ("bos_token", "eos_token")
    }
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read(), special
    source = cfg.get("chat_template")
    if isinstance(source, list):  # named templates: take "default"
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if isinstance(source, str):
        return source, special
    if gguf is not None:
        ck = GGUFCheckpoint(gguf)
        return ck.chat_template(), ck.tokenizer().special_tokens
    return None, {}


def load_tokenizer(model_dir: str | None) -> Tokenizer:
    """The checkpoint's tokenizer: a GGUF file's metadata, or ``tokenizer.json``.

    Falls back to bytes (with a warning: text will not match the model's training) when
    the checkpoint has none."""
    from .gguf import GGUFCheckpoint, gguf_file

    if model_dir:
        gguf = gguf_file(model_dir)
        if gguf is not None:
            return GGUFCheckpoint(gguf).tokenizer()
        if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
            return HFTokenizer.from_dir(model_dir)
    log.warning(
        "no tokenizer in %r: using raw UTF-8 bytes, which do not match a trained model's "
        "vocabulary (outputs will be gibberish)", model_dir,
    )  # fmt: skip
    return ByteTokenizer()
