"""The official ``openai`` SDK against the real server (loopback): every call parses and
the values are right (log-probabilities against a dense reference forward, n samples
against single seeded runs, penalties and batches against the engine alone)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import test_server
from conftest import host_pool

from jax_kvcached.engine.attention import no_cache_attend
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, ByteTokenizer, build_model
from jax_kvcached.serve.app import AuthConfig

KEY = "sk-test-key"
PROMPT_IDS = [256, *range(60, 90)]  # 31 tokens


def _model():
    return build_model(BUILTIN_CONFIGS["tiny-llama"], seed=1)




class Server(test_server.Server):
    """test_server's server (tiny Llama "llama", tiny Qwen2 "qwen") behind an API key,
    with an SDK client."""

    def __init__(self):
        super().__init__(max_batch=8, pages=256, auth=AuthConfig(api_key=KEY))
        self.engine = self.engines["llama"]
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def alone():
    """The same model in an engine of its own: what one request gives by itself."""
    pool = host_pool()
    eng = Engine(_model(), pool, name="alone", max_batch=8, tokenizer=ByteTokenizer())

    def run(prompt, **params):
        return eng.generate([prompt], SamplingParams(**params))[0]

    yield run
    pool.close()


@pytest.fixture(scope="module")
def dense():
    model = _model()

    fwd = jax.jit(lambda ids: model(ids, jnp.arange(ids.shape[1])[None], no_cache_attend))

    def log_softmax_at(tokens):
        ids = np.zeros((1, 128), np.int32)
        ids[0, : len(tokens)] = tokens
        x = np.asarray(fwd(jnp.asarray(ids))[0, : len(tokens)], np.float64)
        return (
            x
            - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - x.max(-1, keepdims=True)
        )

    return log_softmax_at


def test_models_and_the_api_key(server):
    assert [m.id for m in server.client.models.list()] == ["llama", "qwen"]
    assert server.client.models.retrieve("llama").id == "llama"
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("nope")
    bad = openai.OpenAI(base_url=server.client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_completion_logprobs_with_echo_equal_the_log_softmax(server, dense, alone):
    r = server.client.completions.create(
        model="llama", prompt=PROMPT_IDS, max_tokens=4, temperature=0, echo=True, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    c = r.choices[0]
    lp = c.logprobs
    n = len(PROMPT_IDS)
    assert len(lp.tokens) == n + 4 and lp.token_logprobs[0] is None
    tok = ByteTokenizer()
    gen_ids = alone(PROMPT_IDS, max_tokens=4, ignore_eos=True).token_ids  # greedy: the same
    assert c.text == tok.decode(PROMPT_IDS + gen_ids)
    ref = dense(PROMPT_IDS + gen_ids)
    ids = PROMPT_IDS + gen_ids
    for pos in range(1, n + 4):
        assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1][ids[pos]], abs=1e-4), pos
    for pos in range(1, n + 4):  # every token: the top 3 alternatives (+ the prompt's own)
        top = lp.top_logprobs[pos]
        row = ref[pos - 1]
        # byte tokens may share a text ("\ufffd"): values are the row's, the best is first
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(row.max(), abs=1e-4)
        for v in top.values():
            assert np.min(np.abs(row - v)) < 1e-4
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 4
    # lm-eval style scoring: echo, max_tokens 0 -> the prompt alone, with its logprobs
    s = server.client.completions.create(
        model="llama", prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=1
    )
    sc = s.choices[0]
    assert sc.text == tok.decode(PROMPT_IDS) and s.usage.completion_tokens == 0
    assert sc.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-5)
    # n > 1: the forks share the first sample's prefill, and its prompt logprobs
    two = server.client.completions.create(
        model="llama", prompt=PROMPT_IDS, max_tokens=2, echo=True, logprobs=1, n=2, seed=1
    )
    a, b = (c.logprobs.token_logprobs[:n] for c in two.choices)
    assert a == b and None not in a[1:]


def test_chat_logprobs_and_top_logprobs(server):
    r = server.client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    text = ""
    for e in content:
        assert len(e.top_logprobs) == 4 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy: the top one
        assert e.bytes == list(e.token.encode())
        text += e.token
    assert text == r.choices[0].message.content


def test_n_samples_equal_single_seeded_runs_and_share_the_prompt(server, alone):
    forks = server.engine.forks
    r = server.client.completions.create(
        model="llama", prompt=PROMPT_IDS, n=3, seed=11, temperature=1.0, max_tokens=8,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        want = alone(PROMPT_IDS, max_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True)
        assert c.text == want.text
    assert server.engine.forks - forks == 2  # one prefill, two forks
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(PROMPT_IDS)
    chat = server.client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "x"}], n=2, seed=3,
        temperature=1.0, max_tokens=4,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]


def test_best_of_returns_the_most_likely_samples(server, alone):
    r = server.client.completions.create(
        model="llama", prompt=PROMPT_IDS, n=1, best_of=3, seed=21, temperature=1.0,
        max_tokens=6, extra_body={"ignore_eos": True},
    )  # fmt: skip
    runs = [alone(PROMPT_IDS, max_tokens=6, temperature=1.0, seed=21 + i, ignore_eos=True,
                  logprobs=0) for i in range(3)]  # fmt: skip
    best = max(range(3), key=lambda i: (sum(lp for lp, _ in runs[i].logprobs), -i))
    assert len(r.choices) == 1 and r.choices[0].text == runs[best].text
    assert r.usage.completion_tokens == 18  # every sample drawn counts


def test_penalties_bias_min_tokens_and_stop_ids_match_the_engine(server, alone):
    params = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={"70": 5, "71": -100})
    extra = {"repetition_penalty": 1.3, "ignore_eos": True}
    r = server.client.completions.create(
        model="llama", prompt=PROMPT_IDS, max_tokens=8, temperature=0, extra_body=extra, **params
    )
    want = alone(
        PROMPT_IDS, max_tokens=8, presence_penalty=1.2, frequency_penalty=0.6,
        repetition_penalty=1.3, logit_bias=((70, 5.0), (71, -100.0)), ignore_eos=True,
    )  # fmt: skip
    assert r.choices[0].text == want.text
    plain = alone(PROMPT_IDS, max_tokens=8, ignore_eos=True)
    assert want.token_ids != plain.token_ids  # the parameters change the output
    first = plain.token_ids[0]
    stop = server.client.completions.create(
        model="llama", prompt=PROMPT_IDS, max_tokens=8, temperature=0,
        extra_body={"stop_token_ids": [first], "ignore_eos": True},
    )  # fmt: skip
    assert stop.choices[0].finish_reason == "stop" and stop.usage.completion_tokens == 1
    held = server.client.completions.create(
        model="llama", prompt=PROMPT_IDS, max_tokens=8, temperature=0,
        extra_body={"stop_token_ids": [first], "min_tokens": 3, "ignore_eos": True},
    )  # fmt: skip
    assert held.usage.completion_tokens >= 3  # the stop id is held off for 3 tokens


def test_batch_prompts_equal_single_ones(server, alone):
    prompts = ["The quick brown fox", "JAX is", [256, 70, 71, 72]]
    r = server.client.completions.create(
        model="llama", prompt=prompts, max_tokens=5, temperature=0, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in r.choices] == list(range(6))
    tok = ByteTokenizer()
    for i, p in enumerate(prompts):
        want = alone(tok.encode(p) if isinstance(p, str) else p, max_tokens=5, ignore_eos=True)
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == want.text  # greedy


def test_streaming_several_choices_with_logprobs(server):
    kw = dict(model="llama", prompt=PROMPT_IDS, n=2, seed=5, temperature=1.0, max_tokens=6,
              logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    whole = server.client.completions.create(**kw)
    texts, tokens = ["", ""], [[], []]
    for chunk in server.client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs:
                tokens[c.index] += c.logprobs.tokens
    assert texts == [c.text for c in whole.choices]
    assert tokens == [c.logprobs.tokens for c in whole.choices]


def test_harmless_fields_pass_and_unsupported_ones_are_clear_400s(server):
    r = server.client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        metadata={"k": "v"}, store=False, user="u", service_tier="auto",
        parallel_tool_calls=False, response_format={"type": "text"},
    )  # fmt: skip
    assert r.choices[0].message.role == "assistant"
    for kw, param in [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format"),
        (dict(n=17), "n"),
        (dict(top_logprobs=3), "top_logprobs"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            server.client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], **kw
            )
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="llama", prompt="x", suffix="y")


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                           "temp": {"type": "integer"}},
          "required": ["city", "temp"], "additionalProperties": False}  # fmt: skip


def test_structured_outputs_over_the_sdk(server):
    """response_format json_schema and json_object, vLLM's structured_outputs (regex,
    choice), streamed and with n > 1: every finished choice holds its structure."""
    chat = [{"role": "user", "content": "weather?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                  "strict": True}}  # fmt: skip
    r = server.client.chat.completions.create(
        model="llama", messages=chat, max_tokens=200, temperature=1.0, seed=5, n=2,
        response_format=fmt,
    )  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        value = json.loads(c.message.content)
        assert set(value) == {"city", "temp"} and type(value["temp"]) is int
        assert len(value["city"]) <= 5
    obj = server.client.chat.completions.create(
        model="llama", messages=chat, max_tokens=120, temperature=1.0, seed=2,
        extra_body={"structured_outputs": {"json_object": True,
                                           "disable_any_whitespace": True}},
    )  # fmt: skip
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    stream = server.client.completions.create(
        model="llama", prompt="code: ", max_tokens=20, temperature=1.0, seed=1, stream=True,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{4}"}},
    )  # fmt: skip
    text, reasons = "", []
    for chunk in stream:
        text += chunk.choices[0].text
        reasons.append(chunk.choices[0].finish_reason)
    assert re.fullmatch("[A-Z]{2}[0-9]{4}", text) and reasons[-1] == "stop"
    pick = server.client.completions.create(
        model="llama", prompt="pick: ", max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )  # fmt: skip
    assert pick.choices[0].text in ("alpha", "beta")
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(
            model="llama", messages=chat, response_format={
                "type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "bogus"}}},
        )  # fmt: skip
    assert e.value.body["param"] == "response_format" and "bogus" in e.value.body["message"]
    assert e.value.body["code"] == "invalid_structured_output"
    # a model without a chat template: chat is a 400 naming the way out, completions serve
    served = server.app_models["qwen"]
    template, served.chat_template = served.chat_template, None
    try:
        with pytest.raises(openai.BadRequestError) as e:
            server.client.chat.completions.create(model="qwen", messages=chat, max_tokens=2)
        assert e.value.body["code"] == "no_chat_template"
        assert "/v1/completions" in e.value.body["message"]
        assert server.client.completions.create(model="qwen", prompt="x", max_tokens=2).choices
    finally:
        served.chat_template = template
    # the server goes on serving; the SDK's parse helper gets its Pydantic object
    import pydantic

    class Weather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=5)
        temp: int

    parsed = server.client.chat.completions.parse(
        model="llama", messages=chat, response_format=Weather, max_tokens=200,
        temperature=1.0, seed=3,
    )  # fmt: skip
    got = parsed.choices[0].message.parsed
    assert isinstance(got, Weather) and len(got.city) <= 5


def test_langchains_structured_output_and_tools(server):
    """LangChain's OpenAI chat model against the server: ``with_structured_output`` with
    a Pydantic model, and ``bind_tools`` with a named and a required tool choice, each
    give its object or calls (the constraint holds the random model's text to them)."""
    from typing import Literal

    import pydantic
    from langchain_openai import ChatOpenAI

    class Weather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=5)
        temp: int

    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a zone."""
        return zone

    llm = ChatOpenAI(model="llama", base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                     max_tokens=200, temperature=1.0, seed=3)  # fmt: skip
    got = llm.with_structured_output(Weather).invoke("weather in Oslo?")
    assert isinstance(got, Weather) and len(got.city) <= 5
    for choice in ("get_time", "required"):
        msg = llm.bind_tools([get_time], tool_choice=choice,
                             parallel_tool_calls=False).invoke("time?")  # fmt: skip
        assert [(c["name"], set(c["args"])) for c in msg.tool_calls] == [("get_time",
                                                                          {"zone"})]
        assert msg.tool_calls[0]["args"]["zone"] in ("utc", "cet")
        assert msg.response_metadata["finish_reason"] == "tool_calls"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}},
]  # fmt: skip


def test_tool_calls_over_the_sdk(server):
    """A named function and tool_choice required hold the output to calls (whole and
    streamed); the call and its result go back in; tool_choice auto reads the model's
    <tool_call> blocks with the server's hermes parser; a thinking model's thought comes
    apart (the outputs forced by a regex here: the model has random weights)."""
    chat = [{"role": "user", "content": "weather in Oslo?"}]
    named = server.client.chat.completions.create(
        model="llama", messages=chat, tools=TOOLS, max_tokens=100, temperature=1.0, seed=4,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    msg, call = named.choices[0].message, named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    stream = server.client.chat.completions.create(
        model="llama", messages=chat, tools=TOOLS, tool_choice="required", max_tokens=150,
        temperature=1.0, seed=6, stream=True, parallel_tool_calls=False,
    )  # fmt: skip
    calls, reasons = [], []
    for chunk in stream:
        calls += chunk.choices[0].delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    # the call, then its arguments (OpenAI's fragments), one index
    assert {c.index for c in calls} == {0} and reasons[-1] == "tool_calls"
    assert calls[0].id.startswith("call_") and calls[0].function.name in ("get_weather",
                                                                         "get_time")
    json.loads("".join(c.function.arguments or "" for c in calls))
    back = server.client.chat.completions.create(
        model="llama", tools=TOOLS, tool_choice="none", max_tokens=3, messages=[
            *chat, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}],
    )  # fmt: skip
    assert back.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as e:  # auto without the server's parser
        server.client.chat.completions.create(model="llama", messages=chat, tools=TOOLS)
    assert e.value.body["param"] == "tool_choice" and "--tool-call-parser" in e.value.body[
        "message"]  # fmt: skip
    served = server.app_models["qwen"]
    served.tool_parser, served.reasoning_parser = "hermes", "deepseek_r1"
    served.constrain_thought = True  # the regex scripts the thought too (random weights)
    try:
        forced = (r"cold there\.</think>I will check\.<tool_call>\{\"name\": "
                  r"\"get_time\", \"arguments\": \{\"zone\": \"cet\"\}\}</tool_call>")
        kw = dict(model="qwen", messages=chat, tools=TOOLS, max_tokens=120,
                  extra_body={"structured_outputs": {"regex": forced}})  # fmt: skip
        auto = server.client.chat.completions.create(**kw).choices[0]
        assert auto.finish_reason == "tool_calls" and auto.message.content == "I will check."
        assert auto.message.model_extra["reasoning_content"] == "cold there."
        assert [(c.function.name, json.loads(c.function.arguments))
                for c in auto.message.tool_calls] == [("get_time", {"zone": "cet"})]
        deltas = [c.choices[0].delta for c in server.client.chat.completions.create(
            **kw, stream=True) if c.choices]  # fmt: skip
        thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        streamed = [c for d in deltas for c in d.tool_calls or []]
        assert thought == "cold there." and streamed[0].function.name == "get_time"
        assert json.loads("".join(c.function.arguments for c in streamed)) == {"zone": "cet"}
        assert "".join(d.content or "" for d in deltas) == "I will check."
        served.constrain_thought = False  # the regex holds the answer: the thought is free
        stuck = server.client.chat.completions.create(**{**kw, "max_tokens": 8}).choices[0]
        assert stuck.finish_reason == "length" and stuck.message.content == ""
        assert not stuck.message.model_extra["reasoning_content"].startswith("cold")
    finally:
        served.tool_parser = served.reasoning_parser = None
        served.constrain_thought = False


def test_accounting_is_exact_after_the_sdk_calls(server):
    server.loop.stop()  # no request in flight
    for eng in server.engines.values():  # (each model the calls used)
        c, pc = eng.cache, eng.prefix_cache
        assert c.num_used_blocks == pc.num_cached_blocks
        assert set(c.mapped_page_ids()) == {c.page_of(b) for b in pc.cached_blocks()}
        eng.reset_prefix_cache()
    assert server.pool.stats()["mapped_pages"] == 0
