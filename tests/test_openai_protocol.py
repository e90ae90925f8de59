"""Request parsing and incremental detokenization of the OpenAI-compatible server."""

import pytest

from jax_kvcached.engine.detokenizer import TextStream
from jax_kvcached.models import ByteTokenizer
from jax_kvcached.models.chat_template import ChatTemplate
from jax_kvcached.serve.protocol import APIError, parse_chat, parse_completion

TOK = ByteTokenizer()


def feed_all(stream, text):
    out = "".join(stream.feed(b) for b in text.encode())
    return out + stream.flush()


def test_text_stream_holds_back_incomplete_utf8():
    s = TextStream(TOK.decode, [])
    e = "é".encode()
    assert s.feed(ord("a")) == "a"
    assert s.feed(e[0]) == ""  # half a character
    assert s.feed(e[1]) == "é"
    assert s.flush() == ""


def test_text_stream_cuts_at_stop_strings_and_holds_back_their_start():
    s = TextStream(TOK.decode, ["END", "xy"])
    deltas = [s.feed(b) for b in b"abcEN"]
    assert "".join(deltas) == "abc"  # "EN" may start "END"
    assert s.feed(ord("D")) == "" and s.stopped
    assert s.flush() == "" and s.text == "abc"
    s = TextStream(TOK.decode, ["END"])
    assert feed_all(s, "aENb") == "aENb" and not s.stopped  # a false start is released


def test_text_stream_without_stops_is_the_decoded_text():
    s = TextStream(TOK.decode, [])
    assert feed_all(s, "héllo wörld") == "héllo wörld"


def test_parse_completion_defaults_and_errors():
    r = parse_completion({"model": "m", "prompt": "hi"})
    # omitted sampling fields stay None: the served model's defaults fill them in
    assert (r.max_tokens, r.temperature, r.top_p, r.stream, r.stop) == (16, None, None, False, [])
    r = parse_completion({"model": "m", "prompt": [[1, 2, 3]], "stop": "x", "seed": 7})
    assert r.prompts == [[1, 2, 3]] and r.stop == ["x"] and r.sampling(4).seed == 7
    assert parse_completion({"model": "m", "prompt": [1, 2]}).prompts == [[1, 2]]
    assert parse_completion({"model": "m", "prompt": ["a", [3]]}).prompts == ["a", [3]]
    for body, param in [
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "stop": ["a"] * 5}, "stop"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
        ({"model": "m", "prompt": ["a", ""]}, "prompt"),
        ({"model": "m", "prompt": ["a", [1, "b"]]}, "prompt"),
        ({"model": "m", "prompt": ["a"] * 65}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),  # only with echo
        ({"model": "m", "prompt": "x", "n": 17}, "n"),
        ({"model": "m", "prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"model": "m", "prompt": "x", "stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "m", "prompt": "x", "stream_options": {"other": 1}}, "stream_options"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options"),  # not streamed
        ({"model": "m", "prompt": "x", "stream": True,
          "stream_options": {"continuous_usage_stats": 1}}, "continuous_usage_stats"),
    ]:
        with pytest.raises(APIError) as e:
            parse_completion(body)
        assert e.value.status == 400 and e.value.param == param


def test_sampling_parameters_reach_the_samples():
    r = parse_completion({
        "model": "m", "prompt": "x", "n": 2, "best_of": 3, "seed": 10, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"7": -3},
        "min_tokens": 2, "stop_token_ids": [9], "echo": True, "logprobs": 2, "max_tokens": 0,
    })  # fmt: skip
    p = [r.sampling(r.max_tokens, i) for i in range(r.best_of)]
    assert [q.seed for q in p] == [10, 11, 12]  # sample i: seed + i
    q = p[0]
    assert (q.presence_penalty, q.frequency_penalty, q.repetition_penalty) == (0.5, -0.5, 1.2)
    assert q.logit_bias == ((7, -3.0),) and q.stop_token_ids == (9,) and q.min_tokens == 1
    assert q.logprobs == 2 and q.prompt_logprobs and q.max_tokens == 1  # echo scoring
    # best_of > n without logprobs still ranks by them (0 alternatives)
    r = parse_completion({"model": "m", "prompt": "x", "best_of": 2})
    assert r.sampling(4).logprobs == 0
    assert parse_completion({"model": "m", "prompt": "x"}).sampling(4).logprobs is None
    chat = [{"role": "user", "content": "hi"}]
    r = parse_chat({"model": "m", "messages": chat, "logprobs": True, "top_logprobs": 3, "n": 2})
    assert (r.logprobs, r.n, r.best_of) == (3, 2, 2)
    assert parse_chat({"model": "m", "messages": chat, "logprobs": True}).logprobs == 0
    for extra, param in [({"top_logprobs": 2}, "top_logprobs"), ({"echo": True}, "echo"),
                         ({"best_of": 2}, "best_of")]:  # fmt: skip
        with pytest.raises(APIError) as e:
            parse_chat({"model": "m", "messages": chat, **extra})
        assert e.value.param == param


def test_harmless_fields_are_accepted_and_output_changing_ones_refused():
    ok = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"k": "v"}, "store": False, "user": "u", "service_tier": "auto",
        "parallel_tool_calls": True, "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"},
    }  # fmt: skip
    plain = parse_chat({"model": "m", "messages": ok["messages"]})
    assert parse_chat(ok) == plain  # accepted, and they change nothing
    assert parse_completion({"model": "m", "prompt": "x", "store": True}).prompts == ["x"]
    for extra, param, msg in [
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format",
         "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "must be"),
        ({"response_format": "text"}, "response_format", "must be"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"structural_tag": "t"}}, "structured_outputs",
         "not supported"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs", "not JSON"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs", "not both"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools", "letters"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"metadata": "x"}, "metadata", "must be a dict"),
        ({"store": "yes"}, "store", "must be a bool"),
        ({"service_tier": ""}, "service_tier", "must be a str"),
        ({"frobnicate": 1}, "frobnicate", "unrecognized"),
    ]:  # fmt: skip
        with pytest.raises(APIError) as e:
            parse_chat({"model": "m", "messages": ok["messages"], **extra})
        assert e.value.status == 400 and e.value.param == param and msg in e.value.message


def test_parse_chat_flattens_text_parts():
    r = parse_chat({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], "max_completion_tokens": 5})  # fmt: skip
    assert r.messages[1] == {"role": "user", "content": "ab"} and r.max_tokens == 5
    with pytest.raises(APIError, match="only text"):
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]})


def test_chat_templates(tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatTemplate().render(msgs) == "<|user|>\nhi\n<|assistant|>\n"
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.content }}]'
        '{% endfor %}", "bos_token": "<s>"}'
    )
    assert ChatTemplate.for_model(str(tmp_path)).render(msgs) == "<s>[hi]"
    assert ChatTemplate.for_model(None).source == ChatTemplate().source


def test_omitted_sampling_fields_take_the_models_defaults():
    omitted = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert omitted.temperature is None and omitted.top_p is None
    smol = {"temperature": 0.2, "top_p": 0.9}
    p = omitted.sampling(8, defaults=smol)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.2, 0.9, 0, 1.0)
    openai = omitted.sampling(8)  # no model defaults: OpenAI's
    assert (openai.temperature, openai.top_p) == (1.0, 1.0)
    given = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                        "temperature": 0, "top_p": 0.5, "stop": ["END"]})  # fmt: skip
    p = given.sampling(8, defaults=smol)
    assert (p.temperature, p.top_p, p.stop) == (0.0, 0.5, ("END",))  # the request wins


def test_generation_defaults_layer_the_config_and_the_flags(tmp_path):
    import json

    from jax_kvcached.serve.launch import default_name, generation_defaults

    smol = {"temperature": 0.2, "top_p": 0.9}
    assert generation_defaults(smol, "auto", {}) == smol
    assert generation_defaults(smol, "openai", {}) == {}
    assert generation_defaults(smol, "auto", {"temperature": 0.7, "top_k": None}) == {
        "temperature": 0.7, "top_p": 0.9,
    }  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 20}))
    assert generation_defaults(smol, str(tmp_path), {}) == {"top_k": 20}
    with pytest.raises(ValueError, match="--generation-config"):
        generation_defaults(smol, "nope", {})
    assert default_name("smollm2-135m") == "smollm2-135m"
    assert default_name("/models/Qwen2.5-0.5B-Q4_K_M.gguf") == "Qwen2.5-0.5B-Q4_K_M"
    assert default_name("/ckpt/llama/") == "llama"


@pytest.mark.parametrize("field, value", [("priority", False), ("priority", 0.0),
                                          ("skip_special_tokens", 1),
                                          ("spaces_between_special_tokens", 1)])  # fmt: skip
def test_vllm_flags_take_their_own_types_only(field, value):
    """1 == True and False == 0 in Python: such values are refused by type, not accepted."""
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "hi", field: value})
    assert e.value.param == field
    parse_completion({"model": "m", "prompt": "hi", "priority": 0, "skip_special_tokens": True})
