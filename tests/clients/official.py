"""The official `openai` and `anthropic` Python clients against a running `charm serve`.

usage: python official.py BASE_URL API_KEY [TOOLS_BASE_URL]
(needs the openai, anthropic, pydantic and jsonschema packages; TOOLS_BASE_URL: a server whose
chat template defines tool calls, for the tool checks)
Exits non-zero (with the failing check) when an answer is not what the clients expect.
"""

import json
import sys
from typing import List, Literal

import anthropic
import jsonschema
import openai
import pydantic

base, key = sys.argv[1], sys.argv[2]
oa = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
an = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)

models = oa.models.list()
name = models.data[0].id
assert name == "charm-bard-moe", name

# chat, whole and streamed: the same text, usage counted
msgs = [{"role": "user", "content": "Speak, Romeo."}]
whole = oa.chat.completions.create(model=name, messages=msgs, max_tokens=20, temperature=0)
text = whole.choices[0].message.content
assert whole.choices[0].finish_reason in ("length", "stop"), whole
assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0, whole.usage
parts, usage = [], None
for chunk in oa.chat.completions.create(
    model=name, messages=msgs, max_tokens=20, temperature=0, stream=True,
    stream_options={"include_usage": True},
):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage
assert "".join(parts) == text, (parts, text)
assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens, usage

# completions with a stop string
c = oa.completions.create(model=name, prompt="ROMEO. ", max_tokens=30, temperature=0)
full = c.choices[0].text
cut = full[5:9]
s = oa.completions.create(model=name, prompt="ROMEO. ", max_tokens=30, temperature=0, stop=[cut])
assert s.choices[0].text == full[: full.find(cut)], (s.choices[0].text, full, cut)
assert s.choices[0].finish_reason == "stop"

# errors arrive as the client's own exceptions
try:
    oa.chat.completions.create(model=name, messages=[], max_tokens=5)
    raise SystemExit("an empty conversation was accepted")
except openai.BadRequestError as e:
    assert "messages" in str(e), e
try:
    openai.OpenAI(base_url=base + "/v1", api_key="wrong-key-of-some-length", max_retries=0).models.list()
    raise SystemExit("a wrong key was accepted")
except openai.AuthenticationError:
    pass

# the model by its id; a list of prompts: one choice each, in order, each as the prompt alone
assert oa.models.retrieve(name).id == name
prompts = ["ROMEO. ", "JULIET. "]
c = oa.completions.create(model=name, prompt=prompts, max_tokens=8, temperature=0)
assert [ch.index for ch in c.choices] == [0, 1], c
for i, p in enumerate(prompts):
    one = oa.completions.create(model=name, prompt=p, max_tokens=8, temperature=0)
    assert c.choices[i].text == one.choices[0].text, (c.choices[i].text, one.choices[0].text)
# sampled without a seed: a fresh one each time
outs = {
    oa.completions.create(model=name, prompt="ROMEO. ", max_tokens=24, temperature=1.0)
    .choices[0].text
    for _ in range(4)
}
assert len(outs) > 1, outs

# Anthropic messages, whole and streamed (greedy: the same text; `temperature` goes in
# extra_body: the anthropic client (2.17) takes no such argument)
m = an.messages.create(model=name, max_tokens=20, system="Be brief.", messages=msgs,
                       extra_body={"temperature": 0})
assert m.content[0].type == "text" and m.usage.output_tokens > 0, m
with an.messages.stream(model=name, max_tokens=20, system="Be brief.", messages=msgs,
                        extra_body={"temperature": 0}) as st:
    streamed = "".join(st.text_stream)
    final = st.get_final_message()
assert streamed == m.content[0].text, (streamed, m.content[0].text)
assert final.stop_reason == m.stop_reason, (final.stop_reason, m.stop_reason)
try:
    an.messages.create(model=name, max_tokens=0, messages=msgs)
    raise SystemExit("max_tokens 0 was accepted")
except anthropic.BadRequestError:
    pass
# structured output: the openai client's parse helper with a pydantic model
class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    kind: Literal["cat", "dog", "owl"]
    age: int = pydantic.Field(ge=0, le=30)


parse = getattr(oa.chat.completions, "parse", None) or oa.beta.chat.completions.parse
for seed in range(3):
    r = parse(model=name, messages=[{"role": "user", "content": "A pet, please."}],
              response_format=Pet, max_tokens=120, temperature=1, seed=seed)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet), r
    assert r.choices[0].finish_reason == "stop", r

# 51 sampled answers to three schemas (nested objects, arrays with item bounds, enums, bounded
# numbers, required fields): every one validates
schemas = [
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "act": {"type": "integer", "minimum": 1, "maximum": 5},
        "speakers": {"type": "array", "items": {"enum": ["Romeo", "Juliet", "Nurse", "Tybalt"]},
                     "minItems": 1, "maxItems": 3}},
     "required": ["title", "act", "speakers"], "additionalProperties": False},
    {"type": "object", "properties": {
        "place": {"type": "object", "properties": {
            "city": {"enum": ["Verona", "Mantua"]},
            "room": {"type": "string", "maxLength": 12}},
            "required": ["city"], "additionalProperties": False},
        "weight": {"type": "number", "minimum": 0, "maximum": 50, "multipleOf": 0.25},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 20},
                  "minItems": 2, "maxItems": 2}},
     "required": ["place", "weight", "lines"], "additionalProperties": False},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                   "maxItems": 4},
        "note": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["ok", "scores"], "additionalProperties": False},
]
valid = 0
for i in range(51):
    schema = schemas[i % 3]
    r = oa.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=300,
        temperature=1, seed=1000 + i,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i % 3}", "schema": schema, "strict": True}})
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    valid += 1
assert valid == 51

# n choices: choice i is the request with seed + i
three = oa.completions.create(model=name, prompt="ROMEO. ", max_tokens=10, temperature=1, seed=20, n=3)
for i, c in enumerate(three.choices):
    one = oa.completions.create(model=name, prompt="ROMEO. ", max_tokens=10, temperature=1, seed=20 + i)
    assert c.index == i and c.text == one.choices[0].text, (i, c.text, one.choices[0].text)

# echo with logprobs and no completion: the prompt's own log probabilities (the first is None)
e = oa.completions.create(model=name, prompt="ROMEO. What light", max_tokens=0, echo=True, logprobs=1)
lp = e.choices[0].logprobs
assert e.choices[0].text == "ROMEO. What light", e
assert lp.token_logprobs[0] is None and all(x < 0 for x in lp.token_logprobs[1:]), lp

# a model the server does not serve
try:
    oa.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    raise SystemExit("an unknown model was answered")
except openai.NotFoundError as err:
    assert name in str(err), err

# Anthropic's count_tokens: the input tokens of the same request
counted = an.messages.count_tokens(model=name, system="Be brief.", messages=msgs)
assert counted.input_tokens == m.usage.input_tokens, (counted, m.usage)

# tool calls, on a server whose template defines them
if len(sys.argv) > 3:
    ot = openai.OpenAI(base_url=sys.argv[3] + "/v1", api_key=key, max_retries=0)
    at = anthropic.Anthropic(base_url=sys.argv[3], api_key=key, max_retries=0)
    tname = ot.models.list().data[0].id
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                             "required": ["city"]}}}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    # `required` without parallel calls: one call, and the turn ends there
    r = ot.chat.completions.create(model=tname, messages=ask, tools=tools, tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=100, temperature=1, seed=3, **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, r
    assert json.loads(c.message.tool_calls[0].function.arguments)["city"], r
    # `required`: calls until the model ends them, or `length` with the cut call left out
    r = ot.chat.completions.create(model=tname, messages=ask, tools=tools, tool_choice="required",
                                   max_tokens=100, temperature=1, seed=4, **kw)
    c = r.choices[0]
    assert c.finish_reason in ("tool_calls", "length") and c.message.tool_calls, r
    assert "<tool_call>" not in (c.message.content or ""), r
    # a call max_tokens cuts: `length`, no call, no template text
    r = ot.chat.completions.create(model=tname, messages=ask, tools=tools,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                   max_tokens=5, temperature=0, **kw)
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls, r
    assert "<tool_call>" not in (c.message.content or ""), r
    # Anthropic: `any` with parallel use off gives one tool_use block and stops for it
    m2 = at.messages.create(model=tname, max_tokens=100, messages=ask,
                            tools=[{"name": "get_weather", "description": "Weather of a city.",
                                    "input_schema": tools[0]["function"]["parameters"]}],
                            tool_choice={"type": "any", "disable_parallel_tool_use": True})
    uses = [b for b in m2.content if b.type == "tool_use"]
    assert m2.stop_reason == "tool_use" and len(uses) == 1, m2
    # a thinking template's reasoning: a thinking block, whole and streamed alike
    say = [{"role": "user", "content": "Speak, Romeo."}]
    think = {"type": "enabled", "budget_tokens": 1024}
    m3 = at.messages.create(model=tname, max_tokens=60, messages=say, thinking=think,
                            extra_body={"temperature": 0})
    assert m3.content[0].type == "thinking" and m3.content[0].thinking, m3
    with at.messages.stream(model=tname, max_tokens=60, messages=say, thinking=think,
                            extra_body={"temperature": 0}) as st:
        m4 = st.get_final_message()
    assert [b.type for b in m4.content] == [b.type for b in m3.content], (m3, m4)
    assert m4.content[0].thinking == m3.content[0].thinking, (m3, m4)
    m5 = at.messages.create(model=tname, max_tokens=20, messages=say, thinking={"type": "disabled"})
    assert all(b.type == "text" for b in m5.content), m5
print("ok")
