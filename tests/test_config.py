import pytest

from jax_kvcached.memory.config import Config, parse_bytes


@pytest.mark.parametrize(
    "text,expected",
    [
        ("8GiB", 8 << 30),
        ("512MiB", 512 << 20),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        (" 2 mib ", 2 << 20),
        (1 << 20, 1 << 20),
        (2048.0, 2048),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "8 parsecs", "-1GiB", "0", 0, -5, "GiB", 1.5])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)


@pytest.mark.parametrize("bad", [None, True, [1]])
def test_parse_bytes_rejects_types(bad):
    with pytest.raises(TypeError):
        parse_bytes(bad)


def test_defaults_match_kvcached():
    c = Config.from_env({})
    assert c.page_size == 2 << 20
    assert c.gpu_utilization == 0.95
    assert (c.min_reserved_pages, c.max_reserved_pages) == (5, 10)
    assert c.max_cached_tokens == 16000


def test_env_overrides():
    c = Config.from_env(
        {
            "KVCACHED_PAGE_SIZE_MB": "4",
            "KVCACHED_MIN_RESERVED_PAGES": "1",
            "KVCACHED_MAX_RESERVED_PAGES": "3",
            "KVCACHED_MAX_CACHED_TOKENS": "-1",
            "KVCACHED_GPU_UTILIZATION": "0.5",
        }
    )
    assert c.page_size == 4 << 20
    assert (c.min_reserved_pages, c.max_reserved_pages) == (1, 3)
    assert c.max_cached_tokens == -1
    assert c.gpu_utilization == 0.5


@pytest.mark.parametrize(
    "env",
    [
        {"KVCACHED_PAGE_SIZE_MB": "abc"},
        {"KVCACHED_PAGE_SIZE_MB": "0.001"},
        {"KVCACHED_GPU_UTILIZATION": "1.5"},
        {"KVCACHED_MIN_RESERVED_PAGES": "-1"},
        {"KVCACHED_MIN_RESERVED_PAGES": "9", "KVCACHED_MAX_RESERVED_PAGES": "2"},
        {"KVCACHED_MAX_CACHED_TOKENS": "-2"},
    ],
)
def test_env_rejects(env):
    with pytest.raises(ValueError, match="KVCACHED_"):
        Config.from_env(env)
