"""GGUF checkpoints (llama.cpp's single-file format), parsed by :mod:`.gguf_file` and
dequantized by the ``gguf`` package.

One file carries everything: the config (``<arch>.*`` metadata), the weights (F32 / F16 /
BF16 / Q8_0 / Q4_0 / Q4_1, dequantized to the model dtype), the tokenizer (a byte-level
BPE vocabulary with merges and special tokens) and the chat template. llama.cpp stores
the Q and K projections with their rows permuted for its RoPE; they are permuted back so
the weights match the Hugging Face layout our models use.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .config import ModelConfig

_ARCHITECTURES = ("llama", "qwen2")
# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded; the message names the file (and tensor)."""


def is_gguf(path: str) -> bool:
    """True for a ``.gguf`` file, or a folder holding exactly one and no safetensors."""
    return gguf_file(path) is not None


def gguf_file(path: str) -> str | None:
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if os.path.isdir(path):
        names = os.listdir(path)
        ggufs = sorted(n for n in names if n.endswith(".gguf"))
        if len(ggufs) == 1 and not any(n.endswith(".safetensors") for n in names):
            return os.path.join(path, ggufs[0])
    return None


class GGUFCheckpoint:
    """An opened GGUF file: metadata, tensors, tokenizer and chat template."""

    def __init__(self, path: str) -> None:
        from .gguf_file import GGUFFile

        self.path = path
        try:
            self._file = GGUFFile(path)
        except Exception as e:  # truncated, not GGUF, unsupported version...
            raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        self.architecture = self.meta("general.architecture")
        if self.architecture not in _ARCHITECTURES:
            raise GGUFError(
                f"{path}: unsupported architecture {self.architecture!r} "
                f"(supported: {', '.join(_ARCHITECTURES)})"
            )
        self._tensors = self._file.tensors

    # -- metadata ----------------------------------------------------------------------
    def meta(self, key: str, default: Any = ...) -> Any:
        if key not in self._file.metadata:
            if default is ...:
                raise GGUFError(f"{self.path}: metadata {key!r} is missing")
            return default
        return self._file.metadata[key]

    def config(self) -> ModelConfig:
        a = self.architecture
        heads = int(self.meta(f"{a}.attention.head_count"))
        hidden = int(self.meta(f"{a}.embedding_length"))
        if "rope_freqs.weight" in self._tensors or self.meta(f"{a}.rope.scaling.type", None):
            raise GGUFError(f"{self.path}: RoPE scaling in GGUF files is not supported yet")
        tokens = self.meta("tokenizer.ggml.tokens", None)
        vocab = self.meta(f"{a}.vocab_size", None) or (len(tokens) if tokens else None)
        if vocab is None:
            vocab = int(self._tensors["token_embd.weight"].dims[-1])
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.meta(f"{a}.feed_forward_length")),
            num_layers=int(self.meta(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.meta(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(self.meta(f"{a}.attention.key_length", hidden // heads)),
            max_position_embeddings=int(self.meta(f"{a}.context_length", 2048)),
            rope_theta=float(self.meta(f"{a}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(self.meta(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in self._tensors,
            qkv_bias=a == "qwen2" or "blk.0.attn_q.bias" in self._tensors,
            model_type=a,
            bos_token_id=self.meta("tokenizer.ggml.bos_token_id", None),
            eos_token_id=self.meta("tokenizer.ggml.eos_token_id", None),
        )

    # -- weights -----------------------------------------------------------------------
    def tensors(self, cfg: ModelConfig, dtype: Any = np.float32) -> dict[str, np.ndarray]:
        """Every weight under its Hugging Face name, dequantized, in HF layout."""
        out: dict[str, np.ndarray] = {}
        for name in self._tensors:
            hf = _hf_name(name)
            if hf is None:
                raise GGUFError(f"{self.path}: unexpected tensor {name!r}")
            w = self.dequantize(name)
            if hf.endswith("q_proj.weight") or hf.endswith("q_proj.bias"):
                w = _unpermute(w, cfg.num_heads)
            elif hf.endswith("k_proj.weight") or hf.endswith("k_proj.bias"):
                w = _unpermute(w, cfg.num_kv_heads)
            out[hf] = w.astype(dtype, copy=False)
        return out

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32, in numpy (row-major) shape."""
        from gguf import GGMLQuantizationType as Q
        from gguf import quants

        t = self._tensors[name]
        qtype = Q(t.tensor_type)
        supported = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)
        if qtype not in supported:
            raise GGUFError(
                f"{self.path}: tensor {name!r} has type {qtype.name}; supported: "
                f"{', '.join(q.name for q in supported)}"
            )
        try:
            data = self._file.data(t)
            if qtype in (Q.F32, Q.F16):
                w = data.astype(np.float32)
            else:
                w = quants.dequantize(data, qtype)
            return np.ascontiguousarray(w.reshape(t.shape), dtype=np.float32)
        except Exception as e:
            raise GGUFError(
                f"{self.path}: tensor {name!r} ({qtype.name}, {t.shape}) could not be "
                f"read: {type(e).__name__}: {e}"
            ) from e

    # -- tokenizer and chat template ---------------------------------------------------
    def tokenizer(self) -> Any:
        """A ``tokenizers`` byte-level BPE built from the vocabulary and merges."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        from .tokenizer import HFTokenizer

        kind = self.meta("tokenizer.ggml.model", None)
        if kind != "gpt2":
            raise GGUFError(
                f"{self.path}: tokenizer model {kind!r} is not supported (byte-level BPE "
                "'gpt2' only)"
            )
        tokens = list(self.meta("tokenizer.ggml.tokens"))
        merges = [tuple(m.split(" ", 1)) for m in self.meta("tokenizer.ggml.merges")]
        types = list(self.meta("tokenizer.ggml.token_type", [1] * len(tokens)))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False)  # fmt: skip
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
        )  # fmt: skip
        user = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED]
        if user:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        bos = self.meta("tokenizer.ggml.bos_token_id", None)
        eos = self.meta("tokenizer.ggml.eos_token_id", None)
        add_bos = bool(self.meta("tokenizer.ggml.add_bos_token", False))
        return HFTokenizer.from_tokenizer(
            tok, bos_token_id=bos, eos_token_id=eos, add_bos=add_bos,
            special_tokens={"bos_token": _token(tokens, bos), "eos_token": _token(tokens, eos)},
        )  # fmt: skip

    def chat_template(self) -> str | None:
        source = self.meta("tokenizer.chat_template", None)
        return source if isinstance(source, str) and source else None


def _token(tokens: list[str], i: int | None) -> str:
    return tokens[i] if i is not None and 0 <= i < len(tokens) else ""


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's RoPE row permutation of a Q or K projection (weight or bias):
    rows within each head go from (half, pair) order back to (pair, half) order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
