"""Request parsing and incremental detokenization of the OpenAI-compatible server."""

import pytest

from jax_kvcached.models import ByteTokenizer
from jax_kvcached.serve.chat_template import ChatTemplate
from jax_kvcached.serve.protocol import APIError, TextStream, parse_chat, parse_completion

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
    assert (r.max_tokens, r.temperature, r.top_p, r.stream, r.stop) == (16, 1.0, 1.0, False, [])
    r = parse_completion({"model": "m", "prompt": [[1, 2, 3]], "stop": "x", "seed": 7})
    assert r.prompt == [1, 2, 3] and r.stop == ["x"] and r.sampling(4).seed == 7
    for body, param in [
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "stop": ["a"] * 5}, "stop"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": "x", "stream_options": {"other": 1}}, "stream_options"),
    ]:
        with pytest.raises(APIError) as e:
            parse_completion(body)
        assert e.value.status == 400 and e.value.param == param


def test_harmless_fields_are_accepted_and_output_changing_ones_refused():
    ok = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"k": "v"}, "store": False, "user": "u", "service_tier": "auto",
        "parallel_tool_calls": True, "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"},
    }  # fmt: skip
    plain = parse_chat({"model": "m", "messages": ok["messages"]})
    assert parse_chat(ok) == plain  # accepted, and they change nothing
    assert parse_completion({"model": "m", "prompt": "x", "store": True}).prompt == "x"
    for extra, param, msg in [
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported yet"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format",
         "not supported yet"),
        ({"response_format": "text"}, "response_format", "must be"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
        ({"tool_choice": "required"}, "tool_choice", "'none' or 'auto'"),
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
