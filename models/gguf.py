"""GGUF checkpoints (llama.cpp's single-file format), parsed by :mod:`.gguf_file`.

One file carries everything: the config (``<arch>.*`` metadata), the weights (F32 / F16 /
BF16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K: quantized projections and
token tables packed (:mod:`.quant_format`), the rest, or all when asked, dequantized to
the model dtype by the ``gguf`` package), the tokenizer (a byte-level BPE vocabulary
with merges, or a SentencePiece one with scores and byte fallback) and the chat template.
llama.cpp stores a ``llama`` model's Q and K projections with their rows permuted for its
RoPE; they are permuted back so the weights match the Hugging Face layout our models
use. Gemma files store each RMSNorm weight as ``1 + w``; the 1 is taken back off (our
Gemma norm adds it). A mixture of experts' stacked expert tensors (``qwen3moe``,
``deepseek2``, ``gpt-oss``; MXFP4 too) become each expert's weight, dequantized (experts
are not held packed yet). What differs by architecture (fields, tensor names, weight
forms, split tensors) each family declares (:class:`~.family.GGUFArch`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from . import registry
from .config import ModelConfig
from .family import GGUFArch
from .moe import MoEConfig
from .quant_format import GGUF_EXACT, Packed, from_gguf_blocks, nearest_format, quantize

log = logging.getLogger("jax_kvcached.models")

# A mixture of experts' stacked expert tensors (E, out, in) -> each expert's HF name
# (GPT-OSS's biases (E, out) too).
_EXPERT_NAMES = {
    f"ffn_{p}_exps.{kind}": f"{p}_proj.{kind}"
    for p in ("gate", "up", "down")
    for kind in ("weight", "bias")
}
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
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a mixture of experts' router
    # DeepSeek: latent attention, shared experts, the score-correction bias
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    # GPT-OSS: sinks, biases, the router's bias; its pre-MLP norm's name
    "attn_sinks.weight": "self_attn.sinks",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
# HF names of the weights a model can hold packed: projections and token tables.
_PACKABLE = ("_proj.weight", "lm_head.weight", "embed_tokens.weight")


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded; the message names the file (and tensor)."""


def yarn_scaling(
    ck: Any, mscale_all_dim: float | None, *, truncate: bool = True
) -> tuple[tuple[str, Any], ...]:
    """A file's YaRN scaling as a config.json's ``rope_scaling``. DeepSeek's files keep
    ``mscale_all_dim`` (as 0.1 x it, the log multiplier) but not ``mscale``: the two
    are taken equal, as in DeepSeek-V2 / V3's own configs."""
    a = ck.architecture
    s: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(ck.meta(f"{a}.rope.scaling.factor")),
        "original_max_position_embeddings":
            int(ck.meta(f"{a}.rope.scaling.original_context_length")),
        "beta_fast": float(ck.meta(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(ck.meta(f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
    }  # fmt: skip
    if mscale_all_dim:
        s["mscale"] = s["mscale_all_dim"] = mscale_all_dim
    if not truncate:
        s["truncate"] = False  # (OpenAI's YaRN keeps the ramp's ends unrounded)
    return tuple(sorted(s.items()))


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
        arch = registry.gguf_arch(self.architecture)
        if arch is None:
            raise GGUFError(
                f"{path}: unsupported architecture {self.architecture!r} "
                f"(supported: {', '.join(registry.gguf_archs())})"
            )
        self.arch: GGUFArch = arch
        self._tensors = self._file.tensors

    @property
    def tensor_names(self) -> set[str]:
        return set(self._tensors)

    def tensor_dims(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape in numpy order (GGUF stores it reversed)."""
        if name not in self._tensors:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing")
        return tuple(int(d) for d in self._tensors[name].shape)

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
        scaling = self.meta(f"{a}.rope.scaling.type", None)
        if (
            "rope_freqs.weight" in self._tensors
            or scaling not in (None, "none", "yarn")
            or (scaling == "yarn" and not self.arch.yarn)
        ):
            yarn = ", ".join(n for n in registry.gguf_archs() if registry.gguf_arch(n).yarn)
            raise GGUFError(f"{self.path}: RoPE scaling {scaling!r} in a {a} GGUF file is not "
                            f"supported (YaRN in {yarn} files only)")  # fmt: skip
        tokens = self.meta("tokenizer.ggml.tokens", None)
        vocab = self.meta(f"{a}.vocab_size", None) or (len(tokens) if tokens else None)
        if vocab is None:
            vocab = self.tensor_dims("token_embd.weight")[0]
        extra = dict(self.arch.fields(self))
        if scaling == "yarn" and "rope_scaling" not in extra:
            extra["rope_scaling"] = yarn_scaling(self, None)
        return ModelConfig(
            vocab_size=int(extra.pop("vocab_size", vocab)),
            hidden_size=hidden,
            intermediate_size=int(
                extra.pop("intermediate_size", None) or self._dense_width(a, extra.get("moe"))
            ),
            num_layers=int(self.meta(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=extra.pop("num_kv_heads", None)
            or int(self.meta(f"{a}.attention.head_count_kv", heads)),
            head_dim=extra.pop("head_dim", None)
            or int(self.meta(f"{a}.attention.key_length", hidden // heads)),
            max_position_embeddings=int(self.meta(f"{a}.context_length", 2048)),
            rope_theta=float(self.meta(f"{a}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(self.meta(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in self._tensors,
            qkv_bias=extra.pop("qkv_bias", "blk.0.attn_q.bias" in self._tensors),
            model_type=extra.pop("model_type", self.arch.model_type),
            bos_token_id=self.meta("tokenizer.ggml.bos_token_id", None),
            eos_token_id=self.meta("tokenizer.ggml.eos_token_id", None),
            **extra,
        )

    def _dense_width(self, a: str, moe: MoEConfig | None) -> int:
        """A dense MLP's width; a file whose every layer is MoE may lack it (the experts'
        width then stands in: no layer uses it)."""
        key = f"{a}.feed_forward_length"
        return self.meta(key) if moe is None else self.meta(key, moe.intermediate_size)

    # -- weights -----------------------------------------------------------------------
    def tensors(
        self, cfg: ModelConfig, dtype: Any = np.float32, *, packed: bool = False
    ) -> dict[str, np.ndarray | Packed]:
        """Every weight under its Hugging Face name, in HF layout: dequantized, or with
        ``packed`` a quantized projection or token table as :class:`Packed` (Q8_0 / Q4_0 /
        Q4_1 byte for byte, other types requantized to their nearest format)."""
        out: dict[str, np.ndarray | Packed] = {}
        arch = self.arch
        permuted = arch.permuted
        names = {**_LAYER_NAMES, **arch.layer_names}
        merges = {f"{p}.weight": m for m in arch.merges for p in m.parts}
        split: dict[tuple[str, str], dict[str, np.ndarray]] = {}  # (hf, layer) -> parts
        for name in self._tensors:
            if self._experts(name, dtype, out):
                continue
            layer, _, part = name.partition(".")[2].partition(".")
            if name.startswith("blk.") and part in merges:
                split.setdefault((merges[part].hf, layer), {})[part[: -len(".weight")]] = (
                    self.dequantize(name)
                )
                continue
            hf = _hf_name(name, names)
            if hf is None:
                raise GGUFError(f"{self.path}: unexpected tensor {name!r}")
            plain = hf.endswith("kv_b_proj.weight") or ".linear_attn." in hf or ".mamba." in hf
            if packed and hf.endswith(_PACKABLE) and not plain:
                p = self.packed(name)
                if p is not None:
                    heads = cfg.num_heads if hf.endswith("q_proj.weight") else cfg.num_kv_heads
                    if permuted and hf.endswith(("q_proj.weight", "k_proj.weight")):
                        p = p.take_rows(_unpermute(np.arange(p.shape[0]), heads))
                    out[hf] = p
                    continue
            w = self.dequantize(name)
            if permuted and (hf.endswith("q_proj.weight") or hf.endswith("q_proj.bias")):
                w = _unpermute(w, cfg.num_heads)
            elif permuted and (hf.endswith("k_proj.weight") or hf.endswith("k_proj.bias")):
                w = _unpermute(w, cfg.num_kv_heads)
            elif arch.weight is not None:
                w = arch.weight(hf, w)
            out[hf] = w.astype(dtype, copy=False)
        by_hf = {m.hf: m for m in arch.merges}
        for (hf, layer), parts in split.items():
            w = by_hf[hf].join(self.path, layer, parts, cfg)
            out[f"model.layers.{layer}.{hf}"] = w.astype(dtype, copy=False)
        return out

    def _experts(self, name: str, dtype: Any, out: dict) -> bool:
        """A stacked expert tensor ``blk.N.ffn_*_exps.weight`` (E, out, in) as each
        expert's Hugging Face weight (dequantized: experts are not held packed yet; the
        log says so); False for any other tensor."""
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _EXPERT_NAMES:
            return False
        from gguf import GGMLQuantizationType as Q

        w = self.dequantize(name)
        if w.ndim != (3 if name.endswith(".weight") else 2):
            raise GGUFError(f"{self.path}: expert tensor {name!r} has shape {w.shape}")
        qtype = Q(self._tensors[name].tensor_type).name
        if qtype not in ("F32", "F16", "BF16"):
            log.info("%s: %s (%s) dequantized: experts are not held packed yet",
                     self.path, name, qtype)  # fmt: skip
        proj = _EXPERT_NAMES[parts[2]]
        for j in range(w.shape[0]):
            key = f"model.layers.{parts[1]}.mlp.experts.{j}.{proj}"
            out[key] = w[j].astype(dtype, copy=False)
        return True

    def packed(self, name: str) -> Packed | None:
        """Tensor ``name`` packed (None for a float tensor): Q8_0 / Q4_0 / Q4_1 as stored,
        other quantized types dequantized and rounded to :func:`nearest_format`."""
        from gguf import GGMLQuantizationType as Q

        t = self._tensors[name]
        qtype = Q(t.tensor_type).name
        if qtype in GGUF_EXACT:
            if len(t.shape) != 2:
                raise GGUFError(f"{self.path}: tensor {name!r} ({qtype}) is not 2-D: {t.shape}")
            return from_gguf_blocks(self._file.data(t), qtype, t.shape)
        fmt = nearest_format(qtype)
        if fmt is None:
            return None
        w = self.dequantize(name)
        if w.ndim != 2 or w.shape[1] % fmt.group:
            raise GGUFError(f"{self.path}: tensor {name!r} ({qtype}, {w.shape}) is not rows "
                            f"of whole groups of {fmt.group}")  # fmt: skip
        return quantize(w, fmt, source=f"{qtype} requantized")

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32, in numpy (row-major) shape."""
        from gguf import GGMLQuantizationType as Q
        from gguf import quants

        t = self._tensors[name]
        qtype = Q(t.tensor_type)
        supported = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K,
                     Q.Q5_K, Q.Q6_K, Q.MXFP4)  # fmt: skip
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
        """A ``tokenizers`` BPE: byte-level (``gpt2``: vocabulary and merges) or
        SentencePiece (``llama``: vocabulary, scores, byte-fallback tokens)."""
        from tokenizers import AddedToken

        from .tokenizer import HFTokenizer

        kind = self.meta("tokenizer.ggml.model", None)
        tokens = list(self.meta("tokenizer.ggml.tokens"))
        types = list(self.meta("tokenizer.ggml.token_type", [1] * len(tokens)))
        if kind == "gpt2":
            tok = self._byte_level_bpe(tokens)
        elif kind == "llama":
            tok = self._sentencepiece_bpe(tokens)
        else:
            raise GGUFError(
                f"{self.path}: tokenizer model {kind!r} is not supported (byte-level BPE "
                "'gpt2' or SentencePiece 'llama')"
            )
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
        )  # fmt: skip
        known = tok.get_vocab()
        user = [
            t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED and t in known
        ]
        if user:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        bos = self.meta("tokenizer.ggml.bos_token_id", None)
        eos = self.meta("tokenizer.ggml.eos_token_id", None)
        add_bos = bool(self.meta("tokenizer.ggml.add_bos_token", False))
        return HFTokenizer.from_tokenizer(
            tok, bos_token_id=bos, eos_token_id=eos, add_bos=add_bos,
            special_tokens={"bos_token": _token(tokens, bos), "eos_token": _token(tokens, eos)},
        )  # fmt: skip

    def _byte_level_bpe(self, tokens: list[str]) -> Any:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        merges = [tuple(m.split(" ", 1)) for m in self.meta("tokenizer.ggml.merges")]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False)  # fmt: skip
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok

    def _sentencepiece_bpe(self, tokens: list[str]) -> Any:
        """SentencePiece BPE: spaces are ``▁``, unknown bytes fall back to ``<0xNN>``
        tokens. The file has no merges: they are rebuilt from the vocabulary, a token's
        rank its score (Gemma: its place in the file, which its scores do not follow)."""
        from tokenizers import Tokenizer, decoders, models, normalizers

        # Gemma spells tokens of several spaces with real spaces; the text has "▁"s.
        tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
        if self.arch.spm_ranks_by_position:
            rank = {t: -i for i, t in enumerate(tokens)}
        else:
            rank = dict(zip(tokens, (float(x) for x in self.meta("tokenizer.ggml.scores")),
                            strict=True))  # fmt: skip
        vocab = {t: i for i, t in enumerate(tokens)}
        unk = self.meta("tokenizer.ggml.unknown_token_id", None)
        bpe = models.BPE(vocab=vocab, merges=_spm_merges(vocab, rank), fuse_unk=True,
                         byte_fallback=True, unk_token=_token(tokens, unk) or None)  # fmt: skip
        tok = Tokenizer(bpe)
        steps = [normalizers.Replace(" ", "▁")]
        decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if self.meta("tokenizer.ggml.add_space_prefix", self.arch.add_space_prefix):
            steps.insert(0, normalizers.Prepend("▁"))
            decode.append(decoders.Strip(" ", 1, 0))
        tok.normalizer = normalizers.Sequence(steps)
        tok.decoder = decoders.Sequence(decode)
        return tok

    def chat_template(self) -> str | None:
        source = self.meta("tokenizer.chat_template", None)
        return source if isinstance(source, str) and source else None


def _spm_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token whose halves are tokens too, best-ranked
    token first; a token's splits with the longer left half first."""
    found: list[tuple[float, int, int, str, str]] = []
    for tok, r in rank.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in vocab and right in vocab:
                found.append((r, len(left), len(right), left, right))
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(m[3], m[4]) for m in found]


def _token(tokens: list[str], i: int | None) -> str:
    return tokens[i] if i is not None and 0 <= i < len(tokens) else ""


def _hf_name(name: str, layer_names: dict[str, str] = _LAYER_NAMES) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's RoPE row permutation of a Q or K projection (weight or bias):
    rows within each head go from (half, pair) order back to (pair, half) order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
