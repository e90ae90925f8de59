"""Function calling and reasoning, host side: the request's tools and tool_choice, the
constraint that forces a call, the calls read from a model's text (hermes, llama3_json),
the thought split from the content; streamed in any chunking, the same as whole."""

import json

import pytest

from jax_kvcached.serve.chat_output import ChatStream, finish_reason, message
from jax_kvcached.serve.protocol import APIError, parse_chat, parse_completion
from jax_kvcached.serve.reasoning import split
from jax_kvcached.serve.tools import parse_tools, read_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}}}  # fmt: skip
CHAT = [{"role": "user", "content": "hi"}]


def _chat(**body):
    return parse_chat({"model": "m", "messages": CHAT, **body})


def test_tool_choices_and_their_constraints():
    assert _chat(tools=[WEATHER]).tools.choice == "auto"
    assert _chat(tools=[WEATHER], tool_choice="none").structured is None
    named = _chat(tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.structured_param == "tool_choice"
    assert json.loads(named.structured.value) == {**TIME["function"]["parameters"],
                                                  "additionalProperties": False}
    req = _chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(req.structured.value)
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    assert [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]
    # parameters that do not say additionalProperties take only their properties
    loose = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "object", "properties": {
            "b": {"type": "integer"}}}, "c": {"type": "object", "additionalProperties": True,
                                              "properties": {}}}}}}  # fmt: skip
    held = json.loads(_chat(tools=[loose], tool_choice="required").structured.value)
    params = held["items"]["anyOf"][0]["properties"]["parameters"]
    assert params["additionalProperties"] is False
    assert params["properties"]["a"]["additionalProperties"] is False
    assert params["properties"]["c"]["additionalProperties"] is True
    for body, param, words in [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
         "tool_choice", "one of the tools"),
        (dict(tool_choice="required"), "tool_choice", "needs 'tools'"),
        (dict(tools=[WEATHER, WEATHER]), "tools", "twice"),
        (dict(tools=[{"type": "code"}]), "tools", "'type': 'function'"),
        (dict(tools=[WEATHER], tool_choice="required",
              response_format={"type": "json_object"}), "tool_choice", "cannot combine"),
    ]:  # fmt: skip
        with pytest.raises(APIError) as e:
            _chat(**body)
        assert e.value.status == 400 and e.value.param == param and words in e.value.message
    with pytest.raises(APIError, match="chat"):
        parse_completion({"model": "m", "prompt": "x", "tools": [WEATHER]})


def test_tool_messages_reach_the_template_with_object_arguments():
    msgs = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    got = parse_chat({"model": "m", "messages": msgs}).messages
    assert got[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert got[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    for bad in ({"role": "tool", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {
                    "name": "f", "arguments": "{oops"}}]}):  # fmt: skip
        with pytest.raises(APIError):
            parse_chat({"model": "m", "messages": [*CHAT, bad]})


def test_calls_read_from_the_models_text():
    tools = parse_tools({"tools": [WEATHER, TIME]})
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}'
            "</tool_call>")  # fmt: skip
    content, calls = read_calls(text, tools, "hermes")
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "cet"})]
    assert len({c["id"] for c in calls}) == 2
    # an unknown function or bad JSON: the text stays content
    for bad in ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                "<tool_call>{oops</tool_call>", "plain words"):  # fmt: skip
        assert read_calls(bad, tools, "hermes") == (bad, [])
    content, calls = read_calls('{"name": "get_time", "parameters": {"zone": "utc"}}; '
                                '{"name": "get_weather", "parameters": {"city": "Rome"}}',
                                tools, "llama3_json")  # fmt: skip
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time",
                                                                          "get_weather"]
    assert read_calls("sure", tools, "llama3_json") == ("sure", [])
    content, calls = read_calls('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "cet"}}]',
                                tools, "mistral")  # fmt: skip
    assert content is None and calls[0]["function"]["name"] == "get_time"
    assert read_calls('[{"name": "get_time", "arguments": {}}]', tools, "mistral")[1]
    for bad in ('[{"name": "nope", "arguments": {}}]', "[1, 2]", "no calls",
                '[TOOL_CALLS]nope[ARGS]{}', '[TOOL_CALLS]get_time[ARGS]{oops',
                '[TOOL_CALLS]get_time{"zone": "cet"}[TOOL_CALLS]get_weather[ARGS]{}'):
        assert read_calls(bad, tools, "mistral") == (bad, [])
    # Mistral's v11 form: a name and [ARGS] per call, after any content
    content, calls = read_calls('Checking.[TOOL_CALLS]get_time[ARGS]{"zone": "cet"}'
                                '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]'
                                '{"city": "Oslo"}', tools, "mistral")  # fmt: skip
    assert content == "Checking." and [(c["function"]["name"], json.loads(
        c["function"]["arguments"])) for c in calls] == [("get_time", {"zone": "cet"}),
                                                         ("get_weather", {"city": "Oslo"})]
    # the markers skipped as special tokens: name{...} calls of the request's functions
    content, calls = read_calls('get_time{"zone": "utc"} get_weather{"city": "Rome"}', tools,
                                "mistral")  # fmt: skip
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time",
                                                                          "get_weather"]
    for bad in ('get_time{"zone": "utc"} and more', 'getaway{"a": 1}', "get_time is 5"):
        assert read_calls(bad, tools, "mistral") == (bad, [])
    forced = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    _, calls = read_calls('[{"name":"get_time","parameters":{"zone":"utc"}}]', forced, None)
    assert calls[0]["function"]["arguments"] == '{"zone": "utc"}'
    assert read_calls('[{"name":"get_ti', forced, None) == ('[{"name":"get_ti', [])


def test_thought_is_split_from_the_content():
    assert split("<think>a</think>\n\nb", "qwen3") == ("a", "b")
    assert split("no thought", "qwen3") == (None, "no thought")
    assert split("still thinking", "deepseek_r1") == ("still thinking", "")
    assert split("x</think>y", "deepseek_r1") == ("x", "y")
    assert split("<think>x</think>y", None) == (None, "<think>x</think>y")


def _assemble(fragments):
    """Streamed tool-call deltas put together as a client does: by index, the first
    fragment's id and name, the arguments' fragments concatenated."""
    calls = {}
    for frag in fragments:
        for d in frag:
            c = calls.setdefault(d["index"], {"id": None, "function": {"name": None,
                                                                       "arguments": ""}})
            c["id"] = c["id"] or d.get("id")
            f = d.get("function", {})
            c["function"]["name"] = c["function"]["name"] or f.get("name")
            c["function"]["arguments"] += f.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


STREAMED = [  # (tool parser, output, its content)
    ("hermes", '<think>need weather</think>\nChecking <now>.\n<tool_call>{"name": '
     '"get_weather", "arguments": {"city": "Oslo"}}</tool_call>', "Checking <now>."),
    ("mistral", '<think>need weather</think>Checking [now].[TOOL_CALLS]get_weather[ARGS]'
     '{"city": "Oslo"}', "Checking [now]."),
    ("mistral", '<think>need weather</think>get_weather{"city": "Oslo"}', None),
]  # fmt: skip


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("case", range(len(STREAMED)))
def test_a_stream_in_any_chunks_says_what_the_whole_message_says(chunk, case):
    """Thought, content and calls streamed character by character (tags split across
    chunks) add up to the whole output's message; held calls come at the end."""
    tools = parse_tools({"tools": [WEATHER, TIME]})
    parser, text, said = STREAMED[case]
    whole = message(text, tools, parser, "qwen3")
    stream = ChatStream(tools, parser, "qwen3")
    deltas = []
    for i in range(0, len(text), chunk):
        deltas += stream.feed(text[i : i + chunk])
    assert not any("tool_calls" in d for d in deltas)  # held to the end
    deltas += stream.finish()
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = _assemble(d["tool_calls"] for d in deltas if "tool_calls" in d)
    assert thought == whole["reasoning_content"] == "need weather"
    assert (content.strip() or None) == whole["content"] == said
    assert [c["function"] for c in calls] == [c["function"] for c in whole["tool_calls"]]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["id"] == stream.calls[0]["id"]
    calls_of_whole = whole["tool_calls"]
    assert finish_reason("stop", calls_of_whole) == finish_reason("stop", stream.calls) == (
        "tool_calls")  # fmt: skip
    assert finish_reason("length", calls_of_whole) == "length"
    plain = ChatStream(None, None, None)
    assert plain.feed("a <tool_call> b") == [{"content": "a <tool_call> b"}]
