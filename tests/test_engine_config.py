"""One config drives the engine, the server and the command line: the flags are generated
from the config dataclasses, and each rule is validated once, in them."""

import dataclasses
import pathlib

import pytest

import jax_kvcached
from jax_kvcached.cli import build_parser
from jax_kvcached.cli.serve import config_error, from_cli_args
from jax_kvcached.engine.config import ConfigError, EngineConfig, flag_of
from jax_kvcached.serve.config import ServeConfig


def _serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_every_command_line_field_is_a_serve_flag_and_round_trips():
    args = _serve_args("--model", "a=tiny-llama", "--model", "tiny-qwen2", "--max-batch", "3",
                       "--max-num-batched-tokens", "24", "--eviction", "lfu", "--no-warmup",
                       "--host-cache-bytes", "1MiB", "--limit", "a=1GiB", "--port", "9000",
                       "--default-top-k", "5", "--no-access-log")  # fmt: skip
    c = from_cli_args(args)
    assert c.models == ["a=tiny-llama", "tiny-qwen2"] and c.limit == ["a=1GiB"]
    assert (c.port, c.warmup, c.access_log, c.default_top_k) == (9000, False, False, 5)
    e = c.engine
    assert (e.max_batch, e.max_num_batched_tokens, e.eviction) == (3, 24, "lfu")
    assert e.host_cache_bytes == 2**20  # parsed once, in the config
    # Defaults equal the dataclasses' own.
    d = from_cli_args(_serve_args())
    assert d == ServeConfig() and d.engine == EngineConfig() and d.model_sources == [
        "smollm2-135m"]  # fmt: skip
    # vLLM's LoRA flags: several specs after one flag, or the flag again; one slot at least
    lora = from_cli_args(_serve_args("--enable-lora", "--lora-modules", "a=/x", "b=/y",
                                     "--lora-modules", "c=/z"))  # fmt: skip
    assert lora.lora_modules == ["a=/x", "b=/y", "c=/z"] and lora.engine.max_loras == 1
    assert from_cli_args(_serve_args(*lora.flags())) == lora
    # A config's own flags parse back to it (benchmarks start servers from configs).
    assert from_cli_args(_serve_args(*c.flags())) == c and d.flags() == []
    assert "--no-warmup" in c.flags() and c.flags().count("--model") == 2
    odd = ServeConfig(reasoning_parser="qwen3", structured_outputs_in_reasoning=True,
                      engine=EngineConfig(kv_events_token_ids=False, kv_events="tcp://*:5557"))
    assert from_cli_args(_serve_args(*odd.flags())) == odd
    with pytest.raises(ValueError, match="EngineConfig.kv_dtype has no command-line flag"):
        ServeConfig(engine=EngineConfig(kv_dtype="bfloat16")).flags()
    switches = [flag_of(cls, f.name) for cls in (ServeConfig, EngineConfig)
                for f in dataclasses.fields(cls)
                if f.metadata.get("cli") and isinstance(f.default, bool)]  # fmt: skip
    parser_flags = set(vars(_serve_args(*switches)))  # every flag's destination (a switch
    # is only there when given: its default is the dataclass's)
    for cls in (ServeConfig, EngineConfig):
        for f in dataclasses.fields(cls):
            assert (f.name in parser_flags) == bool(f.metadata.get("cli")), f.name


@pytest.mark.parametrize("argv,msg", [
    (["--max-model-len", "1"], "--max-model-len must be >= 2"),
    (["--max-batch", "0"], "--max-batch must be positive"),
    (["--max-batch", "8", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens (4) must "
                                                            "be at least max_batch (8)"),
    (["--max-num-batched-tokens", "32", "--max-prefill-tokens", "16"], "--max-prefill-tokens"),
    (["--max-cached-tokens", "-2"], "--max-cached-tokens must be >= -1"),
    (["--stall-ratio", "1"], "--stall-ratio must be a number above 1"),
    (["--stall-ratio", "nan"], "--stall-ratio must be a number above 1"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--port", "70000"], "--port must be in"),
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--max-loras", "2"], "--max-loras needs --enable-lora"),
    (["--enable-lora", "--max-loras", "-1"], "--max-loras must be >= 0"),
    (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank must be positive"),
])  # fmt: skip
def test_a_broken_rule_names_its_flag(argv, msg):
    with pytest.raises(ConfigError) as e:
        from_cli_args(_serve_args(*argv))
    assert config_error(e.value).startswith(msg), config_error(e.value)


def test_the_library_gets_the_same_errors_naming_the_field():
    with pytest.raises(ConfigError, match="^max_model_len must be >= 2"):
        EngineConfig(max_model_len=1)
    with pytest.raises(ConfigError, match="^eviction must be one of"):
        EngineConfig(eviction="fifo")
    with pytest.raises(ConfigError, match="^host_cache_bytes: cannot parse"):
        EngineConfig(host_cache_bytes="lots")
    assert flag_of(ServeConfig, "warmup") == "--no-warmup"
    c = EngineConfig(max_batch=4)
    assert c.replace(max_batch=2).max_batch == 2
    with pytest.raises(ConfigError):
        c.replace(max_batch=0)


def test_each_rule_is_stated_once_in_the_package():
    """The budgets' and the context's rules live in the config module only."""
    pkg = pathlib.Path(jax_kvcached.__file__).parent
    text = {p: p.read_text() for p in pkg.rglob("*.py")}
    for needle in ("must be at least max_batch", "must be >= 2", "must be at least max_num"):
        where = [p.relative_to(pkg).as_posix() for p, t in text.items() if needle in t]
        assert where == ["engine/config.py"], (needle, where)


def test_the_environments_defaults_are_resolved_once_into_the_engines_config():
    """Fields left to KVCACHED_* come from the pool's settings once, at the engine's
    construction; a value given stays; the engine's config holds the resolved values."""
    from jax_kvcached.memory.config import Config

    env = Config.from_env({"KVCACHED_MAX_CACHED_TOKENS": "64",
                           "KVCACHED_HOST_CACHE_TOKENS": "128",
                           "KVCACHED_HOST_CACHE_BYTES": "1MiB"})  # fmt: skip
    got = EngineConfig().with_defaults(env)
    assert (got.max_cached_tokens, got.host_cache_tokens, got.host_cache_bytes) == (
        64, 128, 1 << 20)
    mine = EngineConfig(max_cached_tokens=0, host_cache_bytes="2MiB").with_defaults(env)
    assert (mine.max_cached_tokens, mine.host_cache_tokens, mine.host_cache_bytes) == (
        0, 128, 2 << 20)
    assert EngineConfig().with_defaults(Config()).max_cached_tokens == 16000
