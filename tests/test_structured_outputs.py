"""Structured outputs through the engine: each constrained output matches its schema,
regex, choice or grammar; a constraint that cannot finish ends with "length"; free rows
in the same batch are untouched; no compile after warm-up; accounting stays exact."""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from conftest import check_group_accounting, host_pool

from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.structured import GrammarCompiler, Structured
from jax_kvcached.models import (
    BUILTIN_CONFIGS,
    ByteTokenizer,
    GGUFCheckpoint,
    build_model,
    pretrained_path,
)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"enum": ["yes", "no"]}},
    "required": ["name", "n", "ok"], "additionalProperties": False,
}  # fmt: skip


def _holds(value, schema=SCHEMA):
    """``value`` is valid against ``schema`` (jsonschema's validator)."""
    jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def engine():
    pool = host_pool()
    eng = Engine(build_model(BUILTIN_CONFIGS["tiny-llama"], seed=0), pool, name="m",
                 max_batch=8, tokenizer=ByteTokenizer())  # fmt: skip
    eng.compile()
    yield eng
    pool.close()


def test_each_constrained_output_holds_its_structure(engine):
    json_spec = Structured("json", json.dumps(SCHEMA), compact=True)
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured=json_spec)
              for s in range(4)]  # fmt: skip
    params += [
        SamplingParams(max_tokens=16, temperature=1.0, seed=7,
                       structured=Structured("choice", json.dumps(["red", "green", "blue"]))),
        SamplingParams(max_tokens=16, temperature=1.0, seed=8,
                       structured=Structured("regex", r"[0-9]{3}-[a-z]{2,4}")),
        SamplingParams(max_tokens=48, temperature=1.0, seed=9,  # GBNF, converted to Lark
                       structured=Structured("grammar", 'root ::= "x" ("ab" | "cd")+ "y"')),
        SamplingParams(max_tokens=60, temperature=1.0, seed=10,
                       structured=Structured("json_object", compact=True)),
    ]  # fmt: skip
    free = SamplingParams(max_tokens=12)
    prompts = [[256, *range(40 + i, 60 + i)] for i in range(len(params) + 1)]
    outs = engine.generate(prompts, [*params, free])
    for o in outs[:4]:
        assert o.finish_reason == "stop", o.text
        _holds(json.loads(o.text))
    assert outs[4].finish_reason == "stop" and outs[4].text in ("red", "green", "blue")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[5].text), outs[5].text
    assert re.fullmatch(r"x(ab|cd)+y", outs[6].text), outs[6].text
    assert isinstance(json.loads(outs[7].text), dict)
    assert {o.finish_reason for o in outs[4:-1]} == {"stop"}
    # the free row of the same batch is what it is alone
    alone = engine.generate([prompts[-1]], free)[0]
    assert outs[-1].token_ids == alone.token_ids and outs[-1].finish_reason == "length"
    assert engine.runner.compiles_after_warmup == 0  # the mask programs were warmed up
    check_group_accounting(engine)


def test_without_the_mask_the_outputs_break_their_structure(engine):
    """The same seeds unconstrained: the model (random weights) writes no such text, so
    the structure above comes from the mask."""
    outs = engine.generate([[256, *range(40 + i, 60 + i)] for i in range(4)],
                           [SamplingParams(max_tokens=80, temperature=1.0, seed=s)
                            for s in range(4)])  # fmt: skip
    for o in outs:
        with pytest.raises(ValueError):
            json.loads(o.text)


def test_a_constraint_that_cannot_finish_ends_with_length(engine):
    p = SamplingParams(max_tokens=10, structured=Structured("regex", "a{50}"))
    out = engine.generate([[256, 65, 66]], p)[0]
    assert out.finish_reason == "length" and out.text == "a" * 10
    check_group_accounting(engine)


def test_a_bad_schema_or_grammar_is_an_error_naming_it(engine):
    for spec, words in [(Structured("json", json.dumps({"type": "bogus"})), "bogus"),
                        (Structured("grammar", "start: undefined_rule"), "undefined_rule"),
                        (Structured("regex", "(unclosed"), "regex")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            engine.grammars.compile(spec)
        with pytest.raises(ValueError, match=words):
            engine.add_request([256, 65], SamplingParams(structured=spec))
    with pytest.raises(ValueError, match="choice"):
        Structured("choice", "[]").grammar()
    with pytest.raises(ValueError, match="kind"):
        Structured("yaml", "x")
    assert engine.num_waiting == 0 and not engine.has_work


def test_the_mask_of_a_real_tokenizer_allows_exactly_the_fitting_tokens():
    """SmolLM2's BPE vocabulary (its GGUF's tokenizer): after '"' in a JSON string of
    digits, the allowed tokens are the vocabulary entries made only of digits (and the
    closing quote's); the bitmask says so bit by bit."""
    ck = GGUFCheckpoint(pretrained_path("smollm2-135m"))
    tok, cfg = ck.tokenizer(), ck.config()
    spec = Structured("regex", "[0-9]+")
    state = GrammarCompiler(tok, cfg.vocab_size, cfg.eos_ids).state(spec)
    bits = np.unpackbits(state.mask().view(np.uint8), bitorder="little")[: cfg.vocab_size]
    allowed = set(np.flatnonzero(bits).tolist())
    digits = {i for i in range(cfg.vocab_size) if (t := tok.decode([i])) and t.isdigit()
              and t.isascii()}  # fmt: skip
    assert allowed == digits and len(digits) >= 10
    assert state.accept(next(iter(digits))) and not state.finished


def test_the_device_mask_matches_the_backends_reference_and_rolls_back():
    """The step's mask program (bits of int32 words, -inf elsewhere) gives llguidance's
    own numpy reference on real masks, rows without a constraint untouched; a matcher
    rolled back gives the mask it gave before."""
    from llguidance.numpy import apply_token_bitmask_inplace

    from jax_kvcached.engine.sampler_programs import mask_rows

    ck = GGUFCheckpoint(pretrained_path("smollm2-135m"))
    tok, cfg = ck.tokenizer(), ck.config()
    compiler = GrammarCompiler(tok, cfg.vocab_size, cfg.eos_ids)
    state = compiler.state(Structured("json", json.dumps(SCHEMA)))
    first = state.mask()
    masks = [first]
    for t in tok.encode('{"name": "ab', add_special_tokens=False):
        assert state.accept(t)
        masks.append(state.mask())
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, cfg.vocab_size)).astype(np.float32)
    words = np.stack([masks[0], masks[-1], masks[2]])
    got = np.asarray(jax.jit(mask_rows)(jnp.asarray(logits), jnp.asarray(words)))
    want = logits.copy()
    apply_token_bitmask_inplace(want[:3], words)
    np.testing.assert_array_equal(got, want)  # rows 3..5 unmasked, as given
    assert np.isinf(got[:3]).any(axis=1).all() and not np.isinf(got[3:]).any()
    state.rollback(len(masks) - 1)
    np.testing.assert_array_equal(state.mask(), first)


def test_smollm2s_constrained_answers_validate():
    """A trained model (SmolLM2-135M-Instruct, its packed GGUF) asked for JSON in chat:
    greedy and sampled answers, each valid against the schema."""

    schema = {"type": "object", "properties": {
        "animal": {"type": "string", "maxLength": 20},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
        "required": ["animal", "legs"], "additionalProperties": False}  # fmt: skip
    pool = host_pool("512MiB", page_size="256KiB")
    eng = Engine.from_pretrained("smollm2-135m", pool, max_batch=4, max_model_len=512)
    spec = Structured("json", json.dumps(schema))
    params = [SamplingParams(max_tokens=60, structured=spec)] + [
        SamplingParams(max_tokens=60, temperature=0.8, seed=s, structured=spec)
        for s in range(3)]  # fmt: skip
    chat = [{"role": "user", "content": "Describe a cat as JSON with its legs."}]
    outs = eng.chat([chat] * len(params), params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
    check_group_accounting(eng)
    pool.close()


def test_a_constrained_steps_forward_pass_overlaps_the_previous_steps_completion(engine):
    """The host's work behind a structured output stays off the device's critical path:
    each constrained step's forward pass is dispatched while the previous step is still
    in flight; only its sampling waits for the masks (the previous tokens taken)."""
    runner, inflight_at_forward = engine.runner, []
    execute = runner.execute

    def recording(step):
        if step.deferred:
            inflight_at_forward.append(engine.num_inflight)
        return execute(step)

    runner.execute = recording
    try:
        p = SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                           structured=Structured("regex", "[a-z]{40}"))  # fmt: skip
        out = engine.generate([[256, 70, 71, 72]], p)[0]
    finally:
        runner.execute = execute
    assert re.fullmatch("[a-z]{12}", out.text) and out.finish_reason == "length"
    # the first step (the prompt) has nothing before it; every decode step overlaps
    assert inflight_at_forward[0] == 0 and set(inflight_at_forward[1:]) == {1}
    assert len(inflight_at_forward) == 12
    check_group_accounting(engine)
