"""LoRA adapters, model side: PEFT folders read and checked against the base, and the
logits of a batch mixing two adapters and base-only rows equal transformers + PEFT's
for each row alone (plain and rsLoRA scaling, attention and MLP targets)."""

import copy
import json

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers

from jax_kvcached.engine.attention import no_cache_attention
from jax_kvcached.models.loader import load_checkpoint
from jax_kvcached.models.lora import (
    AdapterError,
    LoRABatch,
    LoRASlots,
    check_base,
    read_peft,
)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random Llama folder and two PEFT adapters of it: rank 4 on every projection,
    and rank 2 with rsLoRA on q and v (random A and B: PEFT's default B is zeros)."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(root / "base")
    adapters = {}
    for name, kw in (("all4", dict(r=4, lora_alpha=8, target_modules=ALL)),
                     ("qv2", dict(r=2, lora_alpha=4, use_rslora=True,
                                  target_modules=["q_proj", "v_proj"]))):  # fmt: skip
        torch.manual_seed(len(adapters) + 1)
        model = peft.get_peft_model(copy.deepcopy(hf),
                                    peft.LoraConfig(init_lora_weights=False, **kw))
        model.save_pretrained(root / name)
        adapters[name] = model.eval()
    return hf, str(root), adapters


def _ours(model, cfg, ids, slots, lora):
    attend = no_cache_attention(cfg)

    def with_adapters(*args, **kw):
        return attend(*args, **kw)

    if lora is not None:
        with_adapters.lora = LoRABatch(*lora.arrays(), jnp.asarray(slots, jnp.int32))
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return np.asarray(model(jnp.asarray(ids), pos, with_adapters))


def test_a_batch_of_two_adapters_and_the_base_matches_peft_row_by_row(base):
    hf, root, adapters = base
    cfg, model = load_checkpoint(f"{root}/base", dtype=jnp.float32)
    slots = LoRASlots(cfg, max_loras=3, max_rank=8, unroll=False)  # (the layers scan)
    for slot, name in ((1, "all4"), (3, "qv2")):
        adapter = read_peft(f"{root}/{name}", cfg, max_rank=8)
        check_base(adapter, model)
        slots.set(slot, adapter)
    ids = np.random.default_rng(0).integers(0, 300, (3, 12))
    row_slots = np.repeat(np.asarray([1, 0, 3]), 12)  # per token, rows flattened
    got = _ours(model, cfg, ids, row_slots, slots)
    refs = [adapters["all4"], hf, adapters["qv2"]]
    with torch.no_grad():
        want = [r(torch.tensor(ids[i : i + 1])).logits[0].numpy() for i, r in enumerate(refs)]
    for i in range(3):
        np.testing.assert_allclose(got[i], want[i], atol=2e-4 * max(1, np.abs(want[i]).max()))
    # the adapters change the logits (the test could tell them apart), the base row not
    plain = _ours(model, cfg, ids, np.zeros(36, np.int32), None)
    assert np.abs(got[0] - plain[0]).max() > 1e-2 and np.abs(got[2] - plain[2]).max() > 1e-3
    np.testing.assert_allclose(got[1], plain[1], atol=1e-5)
    # an emptied slot is the base again, with the same shapes (no new program)
    slots.set(1, None)
    again = _ours(model, cfg, ids, row_slots, slots)
    np.testing.assert_allclose(again[0], plain[0], atol=1e-5)


def _edit(folder, tmp_path, **changes):
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(folder, out, dirs_exist_ok=True)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return str(out)


def test_an_adapter_that_cannot_serve_the_base_is_an_error_naming_file_and_field(base, tmp_path):
    hf, root, _ = base
    cfg, model = load_checkpoint(f"{root}/base", dtype=jnp.float32)
    for changes, words in [
        (dict(r=4, use_dora=True), "use_dora"),
        (dict(bias="all"), "bias"),
        (dict(target_modules=["embed_tokens"]), "embed_tokens"),
        (dict(r=3), "lora_A"),  # the tensors' rank is 4
        (dict(peft_type="IA3"), "peft_type"),
    ]:
        with pytest.raises(AdapterError, match=words) as e:
            read_peft(_edit(f"{root}/all4", tmp_path, **changes), cfg, max_rank=8)
        assert "adapter_config.json" in str(e.value) or "safetensors" in str(e.value)
    with pytest.raises(AdapterError, match="max LoRA rank 2"):
        read_peft(f"{root}/all4", cfg, max_rank=2)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_peft(str(tmp_path), cfg, max_rank=8)
    other = cfg.__class__(**{**cfg.__dict__, "hidden_size": 64, "head_dim": 16})
    with pytest.raises(AdapterError, match="another model"):
        read_peft(f"{root}/all4", other, max_rank=8)
    few = cfg.__class__(**{**cfg.__dict__, "num_layers": 1})
    with pytest.raises(AdapterError, match="the base has 1 layers"):
        read_peft(f"{root}/all4", few, max_rank=8)


@pytest.fixture(scope="module")
def engine(base):
    """An engine of the base with two adapter slots of rank up to 8, compiled."""
    from conftest import host_pool

    from jax_kvcached.engine.engine import Engine

    _, root, _ = base
    _, model = load_checkpoint(f"{root}/base", dtype=jnp.float32)
    pool = host_pool()
    eng = Engine(model, pool, name="lora", max_batch=4, max_model_len=128, max_loras=2,
                 max_lora_rank=8)  # fmt: skip
    eng.compile()
    yield eng
    pool.close()


def test_the_engine_serves_two_adapters_and_the_base_in_one_batch(base, engine):
    """Greedy tokens of [all4, base, qv2] in one continuous batch equal transformers +
    PEFT's generate for each; loading the adapters compiled nothing; their prefixes are
    cached apart; accounting stays exact."""
    from conftest import check_group_accounting, hf_greedy

    from jax_kvcached.engine.sampling import SamplingParams

    hf, root, adapters = base
    engine.load_adapter("all4", f"{root}/all4")
    engine.load_adapter("qv2", f"{root}/qv2")
    try:
        prompt = np.random.default_rng(1).integers(0, 300, 40).tolist()
        greedy = SamplingParams(max_tokens=8, ignore_eos=True)
        outs = engine.generate([prompt] * 3, greedy, adapter=["all4", None, "qv2"])
        for out, ref in zip(outs, [adapters["all4"], hf, adapters["qv2"]], strict=True):
            assert out.token_ids == hf_greedy(ref, prompt, 8)
        assert len({tuple(o.token_ids) for o in outs}) == 3  # (three different answers)
        assert engine.runner.compiles_after_warmup == 0
        # a prefix is cached per adapter: the same prompt hits under its own adapter only
        again = engine.generate([prompt + [7]] * 2, greedy, adapter=["qv2", "all4"])
        assert all(o.cached_tokens >= 32 for o in again)
        fresh = engine.generate(prompt + [8], greedy, adapter="all4")[0]
        assert fresh.cached_tokens >= 32
        with pytest.raises(ValueError, match="in use"):
            rid = engine.add_request(prompt, greedy, adapter="qv2")
            engine.unload_adapter("qv2")
        engine.abort(rid)
        check_group_accounting(engine)
    finally:
        for name in engine.adapters.names():
            engine.unload_adapter(name)
    with pytest.raises(ValueError, match="no LoRA adapter named 'all4'.*loaded: none"):
        engine.generate(prompt, greedy, adapter="all4")
    # a reloaded name is another adapter to the prefix cache
    engine.load_adapter("all4", f"{root}/qv2")
    try:
        out = engine.generate(prompt + [7], greedy, adapter="all4")[0]
        assert out.cached_tokens == 0 and out.token_ids == again[0].token_ids
    finally:
        engine.unload_adapter("all4")
    assert engine.num_waiting == 0


def test_more_adapters_than_slots_take_turns(base, engine):
    """Three adapters on two slots, one batch: the third waits for an idle slot and
    evicts the least recently used adapter; every answer equals its adapter's alone, an
    evicted adapter placed again finds its cached prefix, and past max_cpu_loras an
    adapter's weights are read from its folder again. Accounting stays exact."""
    from conftest import check_group_accounting

    from jax_kvcached.engine.sampling import SamplingParams

    _, root, _ = base
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = np.random.default_rng(3).integers(0, 300, 40).tolist()
    names = {"a": "all4", "b": "qv2", "c": "all4"}
    for name, folder in names.items():
        engine.load_adapter(name, f"{root}/{folder}")
    table = engine.adapters
    try:
        with pytest.raises(ValueError, match="loaded already"):
            engine.load_adapter("a", f"{root}/all4")
        alone = {n: engine.generate(prompt, greedy, adapter=n)[0] for n in ("a", "b")}
        evictions = table.evictions
        outs = engine.generate([prompt] * 3, greedy, adapter=["a", "b", "c"])
        assert [o.token_ids for o in outs] == [alone["a"].token_ids, alone["b"].token_ids,
                                               alone["a"].token_ids]  # fmt: skip
        assert table.evictions > evictions  # (c took a slot a or b gave up)
        assert [a["slot"] for a in table.stats()["adapters"]].count(None) == 1
        back = engine.generate(prompt, greedy, adapter="a")[0]  # (placed again if evicted)
        assert back.token_ids == alone["a"].token_ids and back.cached_tokens >= 32
        table.max_cpu_loras = 1  # (past it, a placement reads the folder again)
        reads = table.reads
        for n in ("b", "c", "a", "b"):
            assert engine.generate(prompt, greedy, adapter=n)[0].token_ids == alone[
                names[n][:1] == "q" and "b" or "a"].token_ids  # fmt: skip
        assert table.reads > reads
        check_group_accounting(engine)
    finally:
        table.max_cpu_loras = None
        for name in engine.adapters.names():
            engine.unload_adapter(name)


def test_an_engine_without_slots_says_so(base):
    from conftest import host_pool

    from jax_kvcached.engine.engine import Engine

    _, root, _ = base
    _, model = load_checkpoint(f"{root}/base", dtype=jnp.float32)
    pool = host_pool()
    try:
        plain = Engine(model, pool, name="plain", max_batch=2)
        with pytest.raises(ValueError, match="takes no LoRA adapters"):
            plain.load_adapter("a", f"{root}/all4")
    finally:
        pool.close()


def test_the_server_loads_serves_and_unloads_adapters(base, engine):
    """vLLM's routes with the admin key, /v1/models listing the adapter with its parent,
    a completion naming the adapter answering as the engine does, bad loads a 400 that
    names the problem, an unloaded adapter a 404."""
    import httpx
    from conftest import check_group_accounting

    from jax_kvcached.engine.sampling import SamplingParams
    from jax_kvcached.models import ByteTokenizer
    from jax_kvcached.serve.app import AuthConfig, BackgroundServer, ServedModel, create_app
    from jax_kvcached.serve.loop import ServingLoop

    _, root, _ = base
    loop = ServingLoop({"lora": engine}).start()
    auth = AuthConfig(api_key="k", admin_key="adm")
    app = create_app(loop, {"lora": ServedModel(engine, ByteTokenizer())}, auth=auth)
    http = BackgroundServer(app).start()
    user, admin = {"Authorization": "Bearer k"}, {"Authorization": "Bearer adm"}
    prompt = np.random.default_rng(2).integers(0, 256, 20).tolist()

    def complete(model):
        r = httpx.post(f"{http.url}/v1/completions", headers=user, timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})  # fmt: skip
        return r

    def post(path, body, headers=admin):
        return httpx.post(f"{http.url}{path}", json=body, headers=headers, timeout=120)

    try:
        load = {"lora_name": "all4", "lora_path": f"{root}/all4"}
        assert post("/v1/load_lora_adapter", load, user).status_code in (401, 403)
        r = post("/v1/load_lora_adapter", load)
        assert r.status_code == 200 and r.json()["base_model_name"] == "lora", r.text
        from jax_kvcached.serve.top import render, scrape

        assert "LoRA adapter slots" in render(scrape(http.url, api_key="k"))  # (top)
        memory = httpx.get(f"{http.url}/admin/memory", headers=admin).json()
        assert "models" in memory, memory
        memory = memory["models"]["lora"]
        assert [a["name"] for a in memory["lora"]["adapters"]] == ["all4"]
        cards = httpx.get(f"{http.url}/v1/models", headers=user).json()["data"]
        assert {(c["id"], c.get("parent")) for c in cards} == {("lora", None), ("all4", "lora")}
        got = complete("all4")
        assert got.status_code == 200 and got.json()["model"] == "all4"
        loop.stop()  # (the engine alone for the reference, then the server again)
        want = engine.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True),
                               adapter="all4")[0]  # fmt: skip
        loop = ServingLoop({"lora": engine}).start()
        app = create_app(loop, {"lora": ServedModel(engine, ByteTokenizer())}, auth=auth)
        http.stop()
        http = BackgroundServer(app).start()
        assert got.json()["choices"][0]["text"] == ByteTokenizer().decode(want.token_ids)
        assert complete("all4").json()["choices"][0]["text"] != complete("lora").json()[
            "choices"][0]["text"]  # fmt: skip
        for body, status, words in [
            ({"lora_name": "x", "lora_path": f"{root}/nowhere"}, 400, "adapter_config.json"),
            ({"lora_name": "lora", "lora_path": f"{root}/qv2"}, 400, "taken"),
            ({"lora_name": "all4", "lora_path": f"{root}/qv2"}, 400, "taken"),
            ({"lora_path": f"{root}/qv2"}, 400, "lora_name"),
        ]:  # fmt: skip
            r = post("/v1/load_lora_adapter", body)
            assert r.status_code == status and words in r.json()["error"]["message"], r.text
        assert post("/v1/unload_lora_adapter", {"lora_name": "all4"}).status_code == 200
        gone = complete("all4")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert post("/v1/unload_lora_adapter", {"lora_name": "all4"}).status_code == 404
    finally:
        http.stop()
        loop.stop()
        for name in engine.adapters.names():
            engine.unload_adapter(name)
    check_group_accounting(engine)


def test_kv_events_name_the_adapter_of_each_stored_chain(base):
    """An adapter's blocks are stored with its lora_id and lora_name (vLLM's fields), the
    base's with none; the two chains of one prompt are two events, never one."""
    from conftest import host_pool
    from test_kv_events import endpoints, receive_all, subscribe

    from jax_kvcached.engine.engine import Engine
    from jax_kvcached.engine.sampling import SamplingParams

    _, root, _ = base
    _, model = load_checkpoint(f"{root}/base", dtype=jnp.float32)
    pool = host_pool()
    ep, _ = endpoints()
    eng = Engine(model, pool, name="events", max_batch=2, max_loras=1, kv_events=ep)
    try:
        eng.load_adapter("qv2", f"{root}/qv2")
        sub = subscribe(ep)
        prompt = list(range(3, 3 + 40))
        greedy = SamplingParams(max_tokens=2, ignore_eos=True)
        eng.generate([prompt, prompt], greedy, adapter=["qv2", None])
        assert eng.kv_event_publisher.flush()
        stored = [e for _, _, b in receive_all(sub) for e in b.events
                  if type(e).__name__ == "BlockStored"]  # fmt: skip
        loras = sorted(((e.lora_id, e.lora_name, len(e.block_hashes)) for e in stored
                        if e.token_ids[:16] == prompt[:16]), key=str)  # fmt: skip
        assert loras == [(1, "qv2", 2), (None, None, 2)], loras
        sub.close(linger=0)
    finally:
        eng.close()
        pool.close()
