//! Anthropic's Messages API (`POST /v1/messages`) translated into the server's [`Request`] and
//! its answer back into Anthropic's message and event shapes.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value as Json};

use super::auth::authorized;
use super::error::{bad, ApiError};
use super::request::{
    check_model, constraint, grammars, submit, whole, ChatMode, Conversation, Request,
};
use super::scheduler::Event;
use super::settings::{parse, settings, COMMON};
use super::sse::sse;
use super::structured::{self, MustCall};
use super::Shared;
use crate::decode::reasoning::Reasoning;
use crate::decode::tool_calls::ToolFormat;

/// Anthropic content blocks of a whole answer: its text, then its tool calls as `tool_use`
/// blocks (when `format` reads them); and whether it called tools and ended after its calls
/// (not inside one: a call `max_tokens` cut is left out, and the stop reason stays the
/// generation's).
fn anthropic_content(text: String, format: Option<ToolFormat>, id: &str) -> (Json, bool) {
    let (text, calls, cut) = match format {
        Some(f) => {
            let e = f.extract(&text);
            (e.content, e.calls, e.cut)
        }
        None => (text, vec![], false),
    };
    let mut blocks = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        blocks.push(json!({"type": "text", "text": text}));
    }
    for (i, c) in calls.iter().enumerate() {
        blocks.push(json!({"type": "tool_use", "id": format!("toolu_{id}_{i}"), "name": c.name, "input": c.arguments}));
    }
    (Json::Array(blocks), !calls.is_empty() && !cut)
}

/// A `thinking` block of reasoning (charm signs nothing: the signature is empty).
fn thinking_block(text: &str) -> Json {
    json!({"type": "thinking", "thinking": text, "signature": ""})
}

/// The content blocks of a streamed answer as they open and close: a thinking block while the
/// reasoning comes, then a text block.
#[derive(Default)]
struct Blocks {
    /// The open block: `Some(true)` thinking, `Some(false)` text.
    open: Option<bool>,
    /// The index the next block gets.
    next: usize,
}

impl Blocks {
    fn ev(name: &str, data: Json) -> String {
        format!("event: {name}\ndata: {data}\n\n")
    }

    /// Closes the open block, if any.
    fn close(&mut self) -> String {
        match self.open.take() {
            Some(thinking) => {
                let i = self.next - 1;
                let mut out = String::new();
                if thinking {
                    out += &Self::ev(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": i, "delta": {"type": "signature_delta", "signature": ""}}),
                    );
                }
                out + &Self::ev(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": i}),
                )
            }
            None => String::new(),
        }
    }

    /// Opens a block of the kind asked for unless it is the open one.
    fn open(&mut self, thinking: bool) -> String {
        if self.open == Some(thinking) {
            return String::new();
        }
        let mut out = self.close();
        let block = if thinking {
            thinking_block("")
        } else {
            json!({"type": "text", "text": ""})
        };
        out += &Self::ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.next, "content_block": block}),
        );
        self.open = Some(thinking);
        self.next += 1;
        out
    }

    /// A text block, open (for an answer whose text is empty).
    fn open_text(&mut self) -> String {
        self.open(false)
    }

    /// `r` as a thinking delta (nothing when empty).
    fn thinking(&mut self, r: &str) -> String {
        self.delta(true, r)
    }

    /// `c` as a text delta (nothing when empty).
    fn text(&mut self, c: &str) -> String {
        self.delta(false, c)
    }

    /// `s` as a thinking or text delta in a block of that kind (opened if needed); nothing when
    /// empty.
    fn delta(&mut self, thinking: bool, s: &str) -> String {
        if s.is_empty() {
            return String::new();
        }
        let mut out = self.open(thinking);
        let delta = if thinking {
            json!({"type": "thinking_delta", "thinking": s})
        } else {
            json!({"type": "text_delta", "text": s})
        };
        out += &Self::ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.next - 1, "delta": delta}),
        );
        out
    }
}

/// `POST /v1/messages`: Anthropic's Messages API over the same generator.
pub(super) async fn messages(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let a = |e: ApiError| e.anthropic();
    authorized(&s, &h).map_err(a)?;
    let req = request(&s, &body, false).map_err(a)?;
    answer(s, req).await.map_err(a)
}

/// `POST /v1/messages/count_tokens`: the prompt tokens a Messages body would take (its
/// `usage.input_tokens`), without generating.
pub(super) async fn count_tokens(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let a = |e: ApiError| e.anthropic();
    authorized(&s, &h).map_err(a)?;
    let req = request(&s, &body, true).map_err(a)?;
    Ok(axum::Json(json!({"input_tokens": req.prompt.len()})).into_response())
}

/// A Messages body as the server's [`Request`]: the shared settings in OpenAI's names, the
/// conversation (system prompt, text blocks, `tool_use` and `tool_result` blocks) and the tools
/// in the shape the chat templates read.
/// `counting`: a `count_tokens` body (no `max_tokens`; nothing runs).
fn request(s: &Shared, body: &Bytes, counting: bool) -> Result<Request, ApiError> {
    let parsed = parse(body)?;
    let Some(obj) = parsed.as_object() else {
        return Err(bad("the body must be a JSON object"));
    };
    check_model(s, &parsed)?;
    const KNOWN: &[&str] = &[
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "metadata",
        "tools",
        "tool_choice",
        "thinking",
    ];
    for k in obj.keys() {
        if !KNOWN.contains(&k.as_str()) {
            return Err(bad(format!("unknown field `{k}`")));
        }
    }
    // `thinking`: the template's own switch (`enable_thinking`), on or off; the budget is taken
    // as given (the reasoning ends when the model closes it, within max_tokens)
    let think = match obj.get("thinking") {
        None | Some(Json::Null) => None,
        Some(t) => match t["type"].as_str() {
            Some("enabled") => {
                if !(t["budget_tokens"].is_null()
                    || t["budget_tokens"].as_u64().is_some_and(|b| b > 0))
                {
                    return Err(bad("`thinking.budget_tokens` must be a positive integer"));
                }
                Some(true)
            }
            Some("disabled") => Some(false),
            _ => return Err(bad("`thinking.type` must be enabled or disabled")),
        },
    };
    let max_tokens = match counting {
        true => Some(1),
        false => obj.get("max_tokens").and_then(|v| v.as_u64()),
    };
    let Some(max_tokens) = max_tokens.filter(|&n| n > 0) else {
        return Err(bad("`max_tokens` (a positive integer) is required"));
    };
    // the shared settings, in OpenAI's names
    let mut o = json!({"max_tokens": max_tokens});
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stream", "stream"),
        ("stop_sequences", "stop"),
    ] {
        if let Some(v) = obj.get(from) {
            o[to] = v.clone();
        }
    }
    let set = settings(&o, COMMON)?;
    if set.params.temperature > 1.0 {
        return Err(bad("`temperature` is outside 0..1"));
    }
    let Some(t) = &s.template else {
        return Err(bad("this model has no chat template"));
    };
    let mut msgs = Vec::new();
    if let Some(sys) = obj.get("system") {
        msgs.push(msg("system", text_of(sys, "`system`")?));
    }
    let Some(list) = obj
        .get("messages")
        .and_then(|m| m.as_array())
        .filter(|m| !m.is_empty())
    else {
        return Err(bad("`messages` must be a non-empty list"));
    };
    // the same messages in their key order (tool inputs keep theirs)
    let mv: minijinja::Value = serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
    let mlist = mv.get_attr("messages").unwrap_or_default();
    let choice = obj.get("tool_choice");
    let (use_tools, must) = match choice.map(|c| c["type"].as_str()) {
        None => (obj.get("tools").is_some_and(|t| !t.is_null()), None),
        Some(Some("auto")) => (true, None),
        Some(Some("none")) => (false, None),
        Some(Some("any")) => (
            true,
            Some(
                if choice.is_some_and(|c| c["disable_parallel_tool_use"] == true) {
                    MustCall::One
                } else {
                    MustCall::Any
                },
            ),
        ),
        Some(Some("tool")) => match choice.and_then(|c| c["name"].as_str()) {
            Some(n) => (true, Some(MustCall::Named(n.to_string()))),
            None => return Err(bad("`tool_choice.name` is required with type tool")),
        },
        Some(_) => return Err(bad("`tool_choice.type` must be auto, any, tool or none")),
    };
    if use_tools && t.tool_format.is_none() {
        return Err(bad(
            "this model's chat template does not define tool calls charm can read back",
        ));
    }
    for (i, m) in list.iter().enumerate() {
        let blocks = mlist
            .get_item(&minijinja::Value::from(i))
            .and_then(|x| x.get_attr("content"))
            .unwrap_or_default();
        message(m, &blocks, &mut msgs)?;
    }
    let tools = if use_tools {
        tools_for_template(&mv)?
    } else {
        minijinja::Value::from(())
    };
    let conversation = Conversation {
        messages: minijinja::Value::from(msgs),
        tools,
        kwargs: think
            .map(|on| vec![("enable_thinking".to_string(), minijinja::Value::from(on))])
            .unwrap_or_default(),
    };
    let (mut prompt, mut thinking) = conversation.prompt(t, &s.tok)?;
    let tools = if use_tools { t.tool_format } else { None };
    let constraint = match (&must, counting) {
        (Some(m), false) => {
            let format =
                tools.ok_or_else(|| bad("this model's template has no tool-call syntax"))?;
            // Anthropic's tools in OpenAI's shape
            let list: Vec<Json> = obj["tools"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| json!({"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}))
                .collect();
            let spec = structured::tool_grammar(grammars(s)?, format, &Json::Array(list), m)?;
            if thinking {
                // a constrained answer has no reasoning part: the turn's `<think>` is closed
                prompt.extend(s.tok.encode("</think>").map_err(|e| bad(e.to_string()))?);
                thinking = false;
            }
            Some(constraint(s, &spec)?)
        }
        _ => None,
    };
    Ok(Request {
        prompt,
        settings: set,
        chat: Some(ChatMode { thinking, tools }),
        constraint,
    })
}

/// One Anthropic message as template messages (appended to `msgs`): text blocks joined, an
/// assistant's `tool_use` blocks as OpenAI tool calls (their inputs from `mblocks`, the same
/// blocks in key order), a user's `tool_result` blocks as `tool` messages.
fn message(
    m: &Json,
    mblocks: &minijinja::Value,
    msgs: &mut Vec<minijinja::Value>,
) -> Result<(), ApiError> {
    let role = m["role"]
        .as_str()
        .filter(|r| matches!(*r, "user" | "assistant"));
    let Some(role) = role else {
        return Err(bad("each message's `role` must be user or assistant"));
    };
    let Json::Array(blocks) = &m["content"] else {
        msgs.push(msg(role, text_of(&m["content"], "`content`")?));
        return Ok(());
    };
    let (mut text, mut calls) = (String::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        match (b["type"].as_str(), role) {
            (Some("text"), _) => text += b["text"].as_str().unwrap_or_default(),
            (Some("tool_use"), "assistant") => {
                let input = mblocks
                    .get_item(&minijinja::Value::from(j))
                    .and_then(|x| x.get_attr("input"))
                    .unwrap_or_default();
                let name = b["name"].as_str().unwrap_or_default();
                calls.push(minijinja::Value::from_pairs([
                    (
                        "id",
                        minijinja::Value::from(b["id"].as_str().unwrap_or_default()),
                    ),
                    ("type", minijinja::Value::from("function")),
                    (
                        "function",
                        minijinja::Value::from_pairs([
                            ("name", minijinja::Value::from(name)),
                            ("arguments", input),
                        ]),
                    ),
                ]));
            }
            (Some("tool_result"), "user") => {
                let content = match &b["content"] {
                    Json::Null => String::new(),
                    c => text_of(c, "`tool_result` content")?,
                };
                msgs.push(minijinja::Value::from_pairs([
                    ("role", minijinja::Value::from("tool")),
                    (
                        "tool_call_id",
                        minijinja::Value::from(b["tool_use_id"].as_str().unwrap_or_default()),
                    ),
                    ("content", minijinja::Value::from(content)),
                ]));
            }
            _ => {
                return Err(bad(format!(
                    "`content`: {} blocks are not supported in {role} messages",
                    b["type"].as_str().unwrap_or("untyped")
                )))
            }
        }
    }
    if calls.is_empty() {
        if !text.is_empty() || role == "assistant" {
            msgs.push(msg(role, text));
        }
    } else {
        msgs.push(minijinja::Value::from_pairs([
            ("role", minijinja::Value::from(role)),
            ("content", minijinja::Value::from(text)),
            ("tool_calls", minijinja::Value::from(calls)),
        ]));
    }
    Ok(())
}

/// Anthropic's tools in the shape the templates read (OpenAI's).
fn tools_for_template(mv: &minijinja::Value) -> Result<minijinja::Value, ApiError> {
    let list = mv.get_attr("tools").unwrap_or_default();
    let Ok(items) = list.try_iter() else {
        return Err(bad("`tools` must be a list"));
    };
    let converted: Vec<minijinja::Value> = items
        .map(|tool| {
            let get = |k: &str| tool.get_attr(k).unwrap_or_default();
            minijinja::Value::from_pairs([
                ("type", minijinja::Value::from("function")),
                (
                    "function",
                    minijinja::Value::from_pairs([
                        ("name", get("name")),
                        ("description", get("description")),
                        ("parameters", get("input_schema")),
                    ]),
                ),
            ])
        })
        .collect();
    Ok(minijinja::Value::from(converted))
}

/// Anthropic content: a string or a list of text blocks.
fn text_of(v: &Json, what: &str) -> Result<String, ApiError> {
    match v {
        Json::String(t) => Ok(t.clone()),
        Json::Array(blocks) => blocks
            .iter()
            .map(|b| match (b["type"].as_str(), b["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => Err(bad(format!("{what}: only text blocks are supported"))),
            })
            .collect(),
        _ => Err(bad(format!(
            "{what} must be a string or a list of text blocks"
        ))),
    }
}

/// A template message of `role` with text `content`.
fn msg(role: &str, content: String) -> minijinja::Value {
    minijinja::Value::from_pairs([
        ("role", minijinja::Value::from(role)),
        ("content", minijinja::Value::from(content)),
    ])
}

/// The answer to `req` in Anthropic's shapes: one message, or its event stream.
async fn answer(s: Arc<Shared>, req: Request) -> Result<Response, ApiError> {
    let Request {
        prompt,
        settings: set,
        chat,
        constraint,
    } = req;
    let format = chat.and_then(|c| c.tools);
    let thinking = chat.is_some_and(|c| c.thinking);
    let prompt_tokens = prompt.len();
    let rx = submit(&s, prompt, &set, None, constraint)?.remove(0);
    let id = format!("msg_{}", s.next_id.fetch_add(1, Ordering::Relaxed));
    let model = s.opts.model_name.clone();
    let reason = |finish: &str, matched: &Option<String>| match (finish, matched) {
        (_, Some(_)) => "stop_sequence",
        ("length", _) => "max_tokens",
        _ => "end_turn",
    };
    if !set.stream {
        let ans = whole(rx).await?;
        // the reasoning of a turn the template opened with `<think>`: a thinking block first
        let mut split = Reasoning::new(thinking);
        let (r, c) = split.push(&ans.text);
        let (r2, c2) = split.end();
        let (mut content, called) = anthropic_content(c + &c2, format, &id);
        let reasoning = r + &r2;
        if !reasoning.is_empty() {
            if let Some(blocks) = content.as_array_mut() {
                blocks.insert(0, thinking_block(&reasoning));
            }
        }
        let stop = if called {
            "tool_use"
        } else {
            reason(ans.finish, &ans.matched)
        };
        return Ok(axum::Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": ans.matched,
            "usage": {"input_tokens": ans.prompt_tokens, "output_tokens": ans.completion_tokens},
        }))
        .into_response());
    }
    let ev = |name: &str, data: Json| format!("event: {name}\ndata: {data}\n\n");
    let prefix = ev(
        "message_start",
        json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
    );
    let mut blocks = Blocks::default();
    let mut split = Reasoning::new(thinking);
    let mut held = String::new();
    let msg_id = id.clone();
    let stream = sse(rx, prefix, move |e| match e {
        Event::Logprobs(_) | Event::Prompt(_) => (String::new(), false),
        Event::Text(t) => {
            let (r, c) = split.push(&t);
            let mut out = blocks.thinking(&r);
            if format.is_some() {
                // tool calls are read from the whole answer: its text waits for the end
                held += &c;
            } else {
                out += &blocks.text(&c);
            }
            (out, false)
        }
        Event::Done {
            finish,
            matched,
            completion_tokens,
            ..
        } => {
            let (r, c) = split.end();
            let mut out = blocks.thinking(&r);
            let mut stop = reason(finish, &matched);
            let mut uses = vec![];
            if format.is_some() {
                let (content, called) =
                    anthropic_content(std::mem::take(&mut held) + &c, format, &msg_id);
                if called {
                    stop = "tool_use";
                }
                let all = content.as_array().cloned().unwrap_or_default();
                // the text block, if the answer has text (or no call)
                if let Some(t) = all.first().and_then(|b| b["text"].as_str()) {
                    out += &blocks.text(t);
                    out += &blocks.open_text();
                }
                uses = all
                    .into_iter()
                    .filter(|b| b["type"] == "tool_use")
                    .collect();
            } else {
                out += &blocks.text(&c);
                out += &blocks.open_text();
            }
            out += &blocks.close();
            for b in uses {
                let i = blocks.next;
                blocks.next += 1;
                let mut start = b.clone();
                start["input"] = json!({});
                out += &ev(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": i, "content_block": start}),
                );
                out += &ev(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": b["input"].to_string()}}),
                );
                out += &ev(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": i}),
                );
            }
            out += &ev(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": matched}, "usage": {"output_tokens": completion_tokens}}),
            );
            out += &ev("message_stop", json!({"type": "message_stop"}));
            (out, true)
        }
        Event::Failed(m) => (
            ev(
                "error",
                json!({"type": "error", "error": {"type": "api_error", "message": m}}),
            ),
            true,
        ),
    });
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::anthropic_content;
    use crate::decode::tool_calls::ToolFormat;
    use serde_json::json;

    #[test]
    fn anthropic_answers_put_tool_calls_in_tool_use_blocks() {
        let t = "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>";
        let (c, called) = anthropic_content(t.into(), Some(ToolFormat::Glm), "m1");
        assert!(called);
        assert_eq!(
            c,
            json!([{"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "toolu_m1_0", "name": "get_weather", "input": {"city": "Paris"}}])
        );
        let (c, called) = anthropic_content("plain".into(), None, "m2");
        assert!(!called);
        assert_eq!(c, json!([{"type": "text", "text": "plain"}]));
    }
}
