"""Our Flax models against Hugging Face transformers (PyTorch CPU) on the same weights."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jax_kvcached.engine.attention import no_cache_attend
from jax_kvcached.models import (
    ByteTokenizer,
    CheckpointError,
    ModelConfig,
    load_checkpoint,
    load_tokenizer,
)


def _dense(model, ids):
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return np.asarray(model(jnp.asarray(ids), pos, no_cache_attend))


def _hf_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=5000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    return transformers.LlamaForCausalLM(cfg)


def _hf_qwen2():
    cfg = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return transformers.Qwen2ForCausalLM(cfg)


@pytest.fixture(params=["llama", "qwen2"])
def hf_checkpoint(request, tmp_path):
    torch.manual_seed(0)
    model = (_hf_llama if request.param == "llama" else _hf_qwen2)()
    model.eval()
    # A small shard size forces a sharded checkpoint (model.safetensors.index.json).
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    return request.param, model, str(tmp_path)


def test_logits_match_transformers(hf_checkpoint):
    kind, hf, path = hf_checkpoint
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    cfg, model = load_checkpoint(path)
    assert cfg.model_type == kind and cfg.qkv_bias == (kind == "qwen2")
    assert cfg.tie_word_embeddings == (kind == "qwen2")
    ids = np.random.default_rng(1).integers(0, 300, (2, 150))  # past the llama3 old context
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = _dense(model, ids)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)


def test_loader_rejects_mismatched_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(str(tmp_path / "missing"))
    torch.manual_seed(0)
    _hf_qwen2().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # the weights have 2 layers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_checkpoint(str(tmp_path))
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type"):
        load_checkpoint(str(tmp_path))


def test_a_truncated_or_corrupted_safetensors_file_is_an_error_naming_it(tmp_path):
    torch.manual_seed(0)
    _hf_qwen2().save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    # cut in the tensor data, in the header, in the header's length; a garbled header
    for bad in (data[:-100], data[:5000], data[:40], data[:8] + b"\xff" * 50 + data[58:]):
        file.write_bytes(bad)
        with pytest.raises(CheckpointError, match=f"{file}: not a readable safetensors"):
            load_checkpoint(str(tmp_path))
    file.write_bytes(data)
    assert load_checkpoint(str(tmp_path))[0].num_layers == 2  # the whole file loads
    # a sharded checkpoint whose index is garbled, or names a shard that is not there
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{index}: not a safetensors index"):
        load_checkpoint(str(tmp_path))
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "shard-2.safetensors"}}))
    with pytest.raises(CheckpointError, match="shard-2.safetensors: listed in .* but missing"):
        load_checkpoint(str(tmp_path))


def test_config_validation():
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(
            vocab_size=10,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=3,
            num_kv_heads=2,
            head_dim=4,
        )


def test_tokenizers(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "héllo"
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)  # no tokenizer.json
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    hf_tok = load_tokenizer(str(tmp_path))
    assert hf_tok.encode("hello world") == [0, 1]


def test_models_follow_the_interface_and_register_by_architecture():
    import dataclasses

    import jax_kvcached as kv
    from jax_kvcached.engine.engine import Engine
    from jax_kvcached.models import (
        BUILTIN_CONFIGS,
        CausalLM,
        LlamaModel,
        build_model,
        model_class,
        register,
    )

    cfg = BUILTIN_CONFIGS["tiny-qwen2"]
    assert model_class("qwen2") is LlamaModel and isinstance(build_model(cfg), CausalLM)
    with pytest.raises(ValueError, match="unsupported model_type 'mamba' .*llama"):
        model_class("mamba")
    with pytest.raises(ValueError, match="unsupported model_type 'mamba'"):
        ModelConfig.from_hf({"model_type": "mamba"})

    @register("toy-llama")  # a new architecture: one class, registered
    class Toy(LlamaModel):
        pass

    toy = build_model(dataclasses.replace(cfg, model_type="toy-llama"), seed=2)
    assert type(toy) is Toy
    with pytest.raises(ValueError, match="already registered"):
        register("toy-llama")(LlamaModel)
    pool = kv.Pool("16MiB", page_size="64KiB", backend="host")
    eng = Engine(toy, pool, name="toy", max_batch=2)
    ref = Engine(build_model(cfg, seed=2), pool, name="ref", max_batch=2)
    out = [e.generate([[1, 2, 3]])[0].token_ids for e in (eng, ref)]
    assert out[0] == out[1]  # the same weights behind the new name
    p = eng.prompt([1, 2, 3])  # validated once: passed on, it is not checked again
    assert eng.prompt(p) is p and ref.prompt(p) is not p and ref.prompt(p).token_ids == (1, 2, 3)
    with pytest.raises(TypeError, match="CausalLM"):
        Engine(object(), pool, name="bad")
    pool.close()


def test_a_family_is_one_module_and_one_registry_entry(tmp_path):
    """A new family declares its model, config.json reader, GGUF architecture and
    presets in one place; the shared readers find each by name, and a name another
    family holds is refused."""
    import dataclasses

    from jax_kvcached.models import BUILTIN_CONFIGS, LlamaModel, ModelConfig, registry
    from jax_kvcached.models.config import hf_common
    from jax_kvcached.models.family import Family, GGUFArch

    class ToyModel(LlamaModel):
        pass

    preset = dataclasses.replace(BUILTIN_CONFIGS["tiny-llama"], model_type="toy_family")
    fam = registry.add(Family(
        name="toy_family", model=ToyModel, model_types=("toy_family",),
        from_hf=lambda cfg: hf_common(cfg, qk_norm=bool(cfg.get("toy_norms"))),
        gguf=(GGUFArch("toyarch", "toy_family"),), presets={"tiny-toy": preset},
    ))  # fmt: skip
    hf = {"model_type": "toy_family", "vocab_size": 64, "hidden_size": 32, "toy_norms": True,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}  # fmt: skip
    cfg = ModelConfig.from_hf(hf)
    assert cfg.qk_norm and cfg.model_type == "toy_family" and cfg.head_dim == 16
    assert registry.family("toy_family") is fam and type(registry.build_model(cfg)) is ToyModel
    assert BUILTIN_CONFIGS["tiny-toy"] is preset and "toyarch" in registry.gguf_archs()
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert ModelConfig.from_dir(str(tmp_path)) == cfg
    for clash, what in ((dict(model_types=("qwen2",)), "model_type 'qwen2'"),
                        (dict(gguf=(GGUFArch("gemma3", "x"),)), "architecture 'gemma3'"),
                        (dict(presets={"tiny-qwen3": preset}), "preset 'tiny-qwen3'")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{what} is already registered"):
            registry.add(Family(**{"name": "other", "model": ToyModel, "model_types": (),
                                   **clash}))  # fmt: skip


def test_the_shared_readers_name_no_family():
    """The config.json, GGUF and checkpoint readers ask the families; none of them
    names a family's model_type or GGUF architecture (llama: the default type and
    SentencePiece's tokenizer name aside)."""
    import ast
    import pathlib

    import jax_kvcached.models as m
    from jax_kvcached.models import registry

    names = set(registry.supported()) | set(registry.gguf_archs())
    names -= {"llama", "toy_family", "toyarch"}
    assert {"gemma3", "qwen3next", "gpt_oss", "deepseek2", "granitemoehybrid"} <= names
    root = pathlib.Path(m.__file__).parent
    for shared in ("config.py", "gguf.py", "loader.py", "pretrained.py", "registry.py",
                   "family.py", "moe.py", "stack.py", "hybrid.py", "mla.py"):  # fmt: skip
        tree = ast.parse((root / shared).read_text())
        found = {n.value for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and n.value in names}  # fmt: skip
        assert found == set(), f"{shared} names {sorted(found)}"
