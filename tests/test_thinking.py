"""A thinking model's structured output: the thought runs free, the answer after
``</think>`` is held to the constraint (engine.thinking), through the engine and the
chat route's parameters; rollback across the end of the thought."""

import dataclasses
import json

import jsonschema
import numpy as np
import pytest
from conftest import check_group_accounting, host_pool
from tokenizers import Tokenizer

from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.structured import GrammarCompiler, Structured
from jax_kvcached.engine.thinking import ThinkingGrammar
from jax_kvcached.models import BUILTIN_CONFIGS, GGUFCheckpoint, build_model, pretrained_path
from jax_kvcached.models.tokenizer import HFTokenizer
from jax_kvcached.serve.protocol import parse_chat, parse_completion
from jax_kvcached.serve.reasoning import split

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 9}},
          "required": ["n"], "additionalProperties": False}  # fmt: skip
JSON = Structured("json", json.dumps(SCHEMA), compact=True)


def _thinking_tokenizer():
    """SmolLM2's BPE vocabulary with ``<think>`` and ``</think>`` added as tokens of
    their own, as a thinking model's vocabulary has them."""
    smol = GGUFCheckpoint(pretrained_path("smollm2-135m")).tokenizer()
    tok = Tokenizer.from_str(smol.to_json())
    tok.add_tokens(["<think>", "</think>"])
    return HFTokenizer(tok, bos_token_id=smol.bos_token_id, eos_token_id=smol.eos_token_id)


@pytest.fixture(scope="module")
def thinker():
    """A random-weight model over that vocabulary, the engine and the marker ids."""
    tok = _thinking_tokenizer()
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    cfg = dataclasses.replace(BUILTIN_CONFIGS["tiny-llama"], vocab_size=end + 1,
                              eos_token_id=tok.eos_token_id)  # fmt: skip
    pool = host_pool()
    eng = Engine(build_model(cfg, seed=0), pool, name="thinker", max_batch=4, tokenizer=tok)
    eng.compile()
    yield eng, start, end
    pool.close()


def _bits(mask, vocab):
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
               .tolist())  # fmt: skip


def test_the_answer_after_the_thought_holds_its_schema(thinker):
    """deepseek_r1: ``</think>`` (biased to come first) ends the thought, then the answer
    is the schema's; qwen3: ``<think>`` may open the output (biased: it does, and the
    thought ends at once), or the answer starts at once (``</think>`` cannot open it)."""
    eng, start, end = thinker
    cases = [("deepseek_r1", {end: 100.0}), ("qwen3", {start: 50.0, end: 100.0}),
             ("qwen3", {end: 100.0})]  # fmt: skip
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, logit_bias=bias,
                             structured=dataclasses.replace(JSON, reasoning=parser))
              for i, (parser, bias) in enumerate(cases)]  # fmt: skip
    outs = eng.generate([[1, 40, 41, 42]] * 3, params)
    for (parser, _), o in zip(cases, outs, strict=True):
        assert o.finish_reason == "stop", o.text
        thought, content = split(o.text, parser)
        jsonschema.validate(json.loads(content), SCHEMA)
    assert outs[0].token_ids[0] == end and outs[1].token_ids[:2] == [start, end]
    assert start not in outs[2].token_ids and end not in outs[2].token_ids
    assert split(outs[2].text, "qwen3")[0] is None
    check_group_accounting(eng)


def test_the_thought_is_free_and_cannot_end_the_output(thinker):
    """A thought the schema would refuse (``<think>`` over and over) runs free to
    ``max_tokens``: it ends with length, never EOS; the same bias without the thought
    is held by the schema from the first token."""
    eng, start, _ = thinker
    bias = {start: 100.0, eng.tokenizer.eos_token_id: 90.0}
    thinking = SamplingParams(max_tokens=6, logit_bias=bias,
                              structured=dataclasses.replace(JSON, reasoning="deepseek_r1"))
    plain = SamplingParams(max_tokens=40, logit_bias=bias, structured=JSON)
    a, b = eng.generate([[1, 50, 51], [1, 50, 51]], [thinking, plain])
    assert a.finish_reason == "length" and a.token_ids == [start] * 6
    assert b.finish_reason == "stop" and start not in b.token_ids
    jsonschema.validate(json.loads(b.text), SCHEMA)
    check_group_accounting(eng)


def test_the_gate_masks_and_rolls_back_across_the_end_of_the_thought():
    tok = _thinking_tokenizer()
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    vocab, eos = end + 1, tok.eos_token_id
    compiler = GrammarCompiler(tok, vocab, [eos])
    state = compiler.state(dataclasses.replace(JSON, reasoning="qwen3"))
    assert isinstance(state, ThinkingGrammar) and state.thinking
    grammar_first = _bits(compiler.state(JSON).mask(), vocab)
    assert _bits(state.mask(), vocab) == grammar_first | {start}
    assert state.accept(start)
    free = _bits(state.mask(), vocab)
    assert free == set(range(vocab)) - {eos}  # the thought: anything but EOS
    words = tok.encode("no json here", add_special_tokens=False)
    for t in words:
        assert state.accept(t) and state.thinking
    assert state.accept(end) and not state.thinking
    assert _bits(state.mask(), vocab) == grammar_first
    answer = tok.encode('{"n":7}', add_special_tokens=False)
    for t in answer:
        assert state.accept(t)
    assert state.finished
    state.rollback(len(answer) + 2)  # back into the thought, before its last word
    assert state.thinking and not state.finished
    assert _bits(state.mask(), vocab) == free
    assert state.accept(words[-1]) and state.accept(end)
    assert _bits(state.mask(), vocab) == grammar_first
    assert not state.accept(start)  # the grammar refuses it in the answer
    with pytest.raises(ValueError, match="roll back"):
        state.rollback(100)
    with pytest.raises(ValueError, match="reasoning"):
        Structured("json", "{}", reasoning="o1")


def test_a_chat_request_holds_the_answer_of_a_thinking_model():
    """The chat route's parameters carry the served model's reasoning parser into the
    constraint; a completion's constraint holds its whole text."""
    body = {"model": "m", "response_format": {"type": "json_object"}}
    chat = parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.sampling(8, reasoning_parser="qwen3").structured.reasoning == "qwen3"
    assert chat.sampling(8).structured.reasoning is None
    done = parse_completion({**body, "prompt": "x"}).sampling(8, reasoning_parser="qwen3")
    assert done.structured.reasoning is None
