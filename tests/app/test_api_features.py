"""The API's tools, structured output, completions with fill-in-the-middle, embeddings,
penalties, logprobs, several choices and context honesty, driven by the real `openai`
client against a server on loopback. The model is tiny and random, over the bundled
tokenizer with a tool-calling chat template (ChatML with tools, as Qwen2.5's) and
fill-in-the-middle tokens added: what it says is noise, what the server makes of it is not."""

from __future__ import annotations

import copy
import json
import socket
import threading
import time

import httpx
import pytest
import torch

from app.api import ApiOptions, completions, mount
from app.service import Service
from app.store import Store
from engine.config import SamplingParams
from engine.decode.generate import run
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
REPLY_CAP = 24  # the server's --max-reply-tokens here
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(bundled_tokenizer, tmp_path_factory):
    """(openai client, base url, service) of a server on a free loopback port."""
    import uvicorn
    from fastapi import FastAPI
    from openai import OpenAI

    tokenizer = copy.deepcopy(bundled_tokenizer)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]})
    tokenizer.chat_template = TOOL_TEMPLATE
    lm = make_tiny_model("llama-gqa", tokenizer, num_layers=2)
    service = Service(Store(tmp_path_factory.mktemp("api-data")), lm)
    app = FastAPI()
    worker = mount(app, service, ApiOptions(max_reply_tokens=REPLY_CAP))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        yield OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120), url, service
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        worker.close()


def test_a_required_tool_call_comes_back_as_tool_calls_and_a_tool_result_turn_replays(served):
    client, _url, _service = served
    out = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", temperature=0, max_tokens=80)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert call.function.name == "get_time" and set(arguments) == {"zone"}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    after = client.chat.completions.create(model="default", messages=history,
                                           tools=[WEATHER, TIME], temperature=0, max_tokens=8)
    assert after.choices[0].message.content is not None or after.choices[0].message.tool_calls
    assert after.usage.prompt_tokens > out.usage.prompt_tokens  # the call and result were read


def test_a_named_tool_call_streams_as_tool_call_deltas(served):
    client, _url, _service = served
    named = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
        temperature=0, max_tokens=60, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert set(json.loads(calls[0].function.arguments)) == {"zone"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text  # the markup never reaches the content


def test_a_model_whose_template_has_no_tools_is_refused_saying_so(served, bundled_tokenizer,
                                                                   monkeypatch):
    client, _url, service = served
    from openai import BadRequestError

    monkeypatch.setattr(service.host.lm.tokenizer, "chat_template",
                        bundled_tokenizer.chat_template)
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER])
    assert err.value.status_code == 400 and "no tool support" in err.value.message


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_strict_json_schema_output_parses_and_validates(served, stream):
    client, _url, _service = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    asked = dict(model="default", messages=ASK, response_format=fmt, temperature=0.7, seed=3,
                 max_tokens=120)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            **asked, stream=True) if c.choices)
    else:
        text = client.chat.completions.create(**asked).choices[0].message.content
    value = json.loads(text)
    assert set(value) == {"name", "age", "tags"} and isinstance(value["name"], str)
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}


def test_json_object_output_is_an_object(served):
    client, _url, _service = served
    out = client.chat.completions.create(model="default", messages=ASK, max_tokens=60,
                                         response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_completions_fill_the_middle_with_the_models_own_tokens(served):
    client, _url, service = served
    out = client.completions.create(model="default", prompt="def add(a, b):\n    return ",
                                    suffix="\n\nprint(add(1, 2))", max_tokens=6, temperature=0)
    tok = service.host.lm.tokenizer
    layout = "<fim_prefix>def add(a, b):\n    return <fim_suffix>\n\nprint(add(1, 2))<fim_middle>"
    ids = tok(layout, add_special_tokens=False)["input_ids"]
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].text is not None
    _t, plain, _s = run(service.host.lm, ids, SamplingParams(max_new_tokens=6))
    assert out.model_extra["quickdraft"]["token_ids"] == plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))",
        max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == out.choices[0].text


def test_completions_refuse_a_suffix_on_a_model_without_fim_tokens(served, monkeypatch):
    client, _url, _service = served
    from openai import BadRequestError

    monkeypatch.setattr(completions, "FIM_TOKENS", (("<|fim_prefix|>", "<|x|>", "<|y|>"),))
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model="default", prompt="a", suffix="b", max_tokens=2)
    assert "fill-in-the-middle" in err.value.message


def test_embeddings_are_unit_vectors_of_the_models_size_one_per_input(served):
    client, _url, service = served
    out = client.embeddings.create(model="default", input=["red apple", "blue sky", "red apple"])
    vectors = torch.tensor([d.embedding for d in out.data])
    assert vectors.shape == (3, service.host.lm.model.config.hidden_size)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-4)
    assert torch.allclose(vectors[0], vectors[2], atol=1e-5)
    assert not torch.allclose(vectors[0], vectors[1], atol=1e-3)
    floats = client.embeddings.create(model="default", input="red apple",
                                      encoding_format="float")
    assert torch.allclose(torch.tensor(floats.data[0].embedding), vectors[0], atol=1e-5)


def test_penalties_and_logit_bias_change_the_reply_as_the_engine_does(served):
    client, _url, service = served
    lm = service.host.lm
    asked = dict(model="default", messages=ASK, temperature=0, max_tokens=16)
    plain = client.chat.completions.create(**asked).model_extra["quickdraft"]["token_ids"]
    shaped = client.chat.completions.create(
        **asked, presence_penalty=2, frequency_penalty=2,
        logit_bias={str(plain[0]): -100}).model_extra["quickdraft"]["token_ids"]
    assert shaped != plain and shaped[0] != plain[0]
    prompt = [*lm.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]]
    params = SamplingParams(max_new_tokens=16, presence_penalty=2, frequency_penalty=2,
                            logit_bias=((plain[0], -100.0),))
    assert run(lm, prompt, params)[1] == shaped


def test_logprobs_report_the_chosen_token_and_its_alternatives(served):
    client, _url, _service = served
    out = client.chat.completions.create(model="default", messages=ASK, temperature=0,
                                         max_tokens=5, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top
        assert entry.token == entry.top_logprobs[0].token


def test_n_choices_differ_and_each_repeats_with_its_seed(served):
    client, _url, _service = served
    asked = dict(model="default", messages=ASK, temperature=1.0, max_tokens=12, seed=11, n=2)
    first = client.chat.completions.create(**asked)
    again = client.chat.completions.create(**asked)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1] and texts[0] != texts[1]
    assert texts == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 24


def test_a_prompt_longer_than_the_context_is_400_naming_both_numbers(served):
    client, _url, service = served
    from openai import BadRequestError

    long = [{"role": "user", "content": " ".join(["apple"] * 600)}]  # > 512 tokens
    for stream in (False, True):
        with pytest.raises(BadRequestError) as err:
            client.chat.completions.create(model="default", messages=long, max_tokens=10,
                                           stream=stream)
        assert err.value.code == "context_length_exceeded"
        assert "512" in err.value.message and "for the reply" in err.value.message


def test_a_reply_without_max_tokens_runs_to_the_servers_cap(served):
    client, _url, service = served
    service.host.lm.eos_ids = ()  # it cannot end by itself here
    try:
        out = client.chat.completions.create(model="default", messages=ASK, temperature=0)
    finally:
        service.host.lm.eos_ids = (service.host.lm.tokenizer.eos_token_id,)
    assert out.usage.completion_tokens == REPLY_CAP and out.choices[0].finish_reason == "length"


def test_models_by_id_and_unknown_paths_answer_openais_error_object(served):
    client, url, service = served
    assert client.models.retrieve("default").id == service.host.lm.model_id
    for method, path, status in (("GET", "/models/other", 404), ("GET", "/nothing", 404),
                                 ("DELETE", "/chat/completions", 405),
                                 ("GET", "/embeddings", 405)):
        r = httpx.request(method, url + path)
        assert r.status_code == status, (method, path)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("extra,param,words", [
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
     "tool_choice", "one of the tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": 7}}}}, "response_format", "JSON schema"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "beyond"),
    ({"n": 9}, "n", "from 1 to 4"),
])
def test_each_unsupported_case_is_a_400_that_says_why(served, extra, param, words):
    client, _url, _service = served
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="default", messages=ASK, max_tokens=4,
                                       extra_body=extra)
    assert err.value.body["param"] == param and words in err.value.message
