"""The official `openai` and `anthropic` Python clients against a running `charm serve`.

usage: python official.py BASE_URL API_KEY
Exits non-zero (with the failing check) when an answer is not what the clients expect.
"""

import sys

import anthropic
import openai

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

# Anthropic messages, whole and streamed (sampled with the server's default seed: repeatable)
m = an.messages.create(model=name, max_tokens=20, system="Be brief.", messages=msgs)
assert m.content[0].type == "text" and m.usage.output_tokens > 0, m
with an.messages.stream(model=name, max_tokens=20, system="Be brief.", messages=msgs) as st:
    streamed = "".join(st.text_stream)
    final = st.get_final_message()
assert streamed == m.content[0].text, (streamed, m.content[0].text)
assert final.stop_reason == m.stop_reason, (final.stop_reason, m.stop_reason)
try:
    an.messages.create(model=name, max_tokens=0, messages=msgs)
    raise SystemExit("max_tokens 0 was accepted")
except anthropic.BadRequestError:
    pass
print("ok")
