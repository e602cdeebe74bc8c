//! OpenAI's API: `POST /v1/completions` and `POST /v1/chat/completions` translated into the
//! server's [`Request`], and the answer back into OpenAI's completion and chunk shapes (reasoning
//! as `reasoning_content`, tool calls as `tool_calls`, log probabilities).

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
    check_model, constraint, grammars, merged, submit_all, usage, whole, ChatMode, Conversation,
};
use super::scheduler::{Event, TokenLogprob};
use super::settings::{parse, settings, Settings, COMMON};
use super::sse::sse;
use super::structured::{self, MustCall};
use super::{now, Shared};
use crate::decode::grammar::Constraint;
use crate::decode::reasoning::Reasoning;
use crate::decode::tokenizer::TextTokenizer;
use crate::decode::tool_calls::ToolFormat;

/// `POST /v1/completions`: a prompt (or a list of prompts) of text or token ids.
pub(super) async fn completions(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let body = parse(&body)?;
    let set = settings(&body, &[COMMON, &["prompt"], structured::FIELDS].concat())?;
    check_model(&s, &body)?;
    let prompts = prompts(&s.tok, &body["prompt"], set.echo)?;
    let constraint = match structured::requested(&body)? {
        Some(spec) => Some(constraint(&s, &spec)?),
        None => None,
    };
    answer(s, prompts, set, None, constraint).await
}

/// One prompt of a request: its ids, and its text when it comes back before the answer (`echo`).
struct Prompted {
    ids: Vec<u32>,
    echo: Option<String>,
}

/// The prompts of a completions body, in every shape OpenAI's API takes: a string, a list of
/// strings, a list of token ids, a list of token-id lists. With `echo`, each with its text.
fn prompts(tok: &TextTokenizer, p: &Json, echo: bool) -> Result<Vec<Prompted>, ApiError> {
    const SHAPES: &str = "`prompt` must be a string, a list of strings, a list of token ids or a list of token-id lists";
    let ids = |a: &[Json], which: &str| -> Result<Vec<u32>, ApiError> {
        let ids = a
            .iter()
            .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| bad(SHAPES))?;
        tok.check_ids(&ids)
            .map_err(|e| bad(format!("`prompt`{which}: {e}")))?;
        Ok(ids)
    };
    let text = |t: &str, which: &str| -> Result<Prompted, ApiError> {
        Ok(Prompted {
            ids: tok
                .encode(t)
                .map_err(|e| bad(format!("`prompt`{which}: {e}")))?,
            echo: echo.then(|| t.to_string()),
        })
    };
    let of_ids = |ids: Vec<u32>| -> Result<Prompted, ApiError> {
        let echo = match echo {
            true => Some(tok.decode(&ids).map_err(|e| bad(e.to_string()))?),
            false => None,
        };
        Ok(Prompted { ids, echo })
    };
    match p {
        Json::String(t) => Ok(vec![text(t, "")?]),
        Json::Array(a) if a.is_empty() => Err(bad("`prompt` is an empty list")),
        Json::Array(a) if a.iter().all(Json::is_number) => Ok(vec![of_ids(ids(a, "")?)?]),
        Json::Array(a) if a.iter().all(Json::is_string) => a
            .iter()
            .enumerate()
            .map(|(i, t)| text(t.as_str().unwrap_or_default(), &format!("[{i}]")))
            .collect(),
        Json::Array(a) if a.iter().all(Json::is_array) => a
            .iter()
            .enumerate()
            .map(|(i, l)| of_ids(ids(l.as_array().map_or(&[][..], |l| l), &format!("[{i}]"))?))
            .collect(),
        _ => Err(bad(SHAPES)),
    }
}

/// `POST /v1/chat/completions`: the messages rendered by the model's chat template.
pub(super) async fn chat_completions(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let mut parsed = parse(&body)?;
    // tools are the template's business: taken out before the shared checks
    let tools_given = parsed.get("tools").is_some_and(|t| !t.is_null());
    let parsed_tools = parsed.get("tools").cloned().unwrap_or(Json::Null);
    let tool_choice = parsed.get("tool_choice").cloned().unwrap_or(Json::Null);
    let parallel = match parsed.get("parallel_tool_calls") {
        None | Some(Json::Null) => true,
        Some(Json::Bool(b)) => *b,
        Some(_) => return Err(bad("`parallel_tool_calls` must be true or false")),
    };
    if let Some(o) = parsed.as_object_mut() {
        o.remove("tools");
        o.remove("tool_choice");
        o.remove("parallel_tool_calls");
    }
    let set = settings(
        &parsed,
        &[
            COMMON,
            &["messages", "max_completion_tokens", "chat_template_kwargs"],
            structured::FIELDS,
        ]
        .concat(),
    )?;
    check_model(&s, &parsed)?;
    if set.echo {
        return Err(bad("`echo` is for /v1/completions"));
    }
    let Some(t) = &s.template else {
        return Err(bad("this model has no chat template: use /v1/completions"));
    };
    let (use_tools, must) = match (&tool_choice, tools_given) {
        (Json::Null, false) => (false, None),
        (_, false) => return Err(bad("`tool_choice` needs `tools`")),
        (Json::Null, true) => (true, None),
        (Json::String(c), true) if c == "auto" => (true, None),
        (Json::String(c), true) if c == "none" => (false, None),
        (Json::String(c), true) if c == "required" => (
            true,
            Some(if parallel {
                MustCall::Any
            } else {
                MustCall::One
            }),
        ),
        (Json::Object(_), true) if tool_choice["type"] == "function" => {
            match tool_choice["function"]["name"].as_str() {
                Some(n) => (true, Some(MustCall::Named(n.to_string()))),
                None => return Err(bad("`tool_choice.function.name` is required")),
            }
        }
        _ => {
            return Err(bad(
                "`tool_choice` must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ))
        }
    };
    if use_tools && t.tool_format.is_none() {
        return Err(bad(
            "this model's chat template does not define tool calls charm can read back",
        ));
    }
    let ok_messages = parsed["messages"].as_array().is_some_and(|m| {
        !m.is_empty()
            && m.iter().all(|x| {
                x["role"].is_string()
                    && (x["content"].is_string()
                        || x["content"].is_array()
                        || x["content"].is_null())
            })
    });
    if !ok_messages {
        return Err(bad(
            "`messages` must be a non-empty list of {role, content} objects",
        ));
    }
    // the template sees the messages in their key order
    let v: minijinja::Value = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    let conversation = Conversation::openai(&v, t, use_tools)?;
    // the reasoning part of a turn the template opened with `<think>` (GLM with thinking on) is
    // returned apart, as `reasoning_content`
    let (mut prompt, mut thinking) = conversation.prompt(t, &s.tok)?;
    let tools = if use_tools { t.tool_format } else { None };
    let spec = match (&must, structured::requested(&parsed)?) {
        (Some(_), Some(_)) => return Err(bad(
            "`tool_choice` that requires a call and a structured-output field cannot be combined",
        )),
        (Some(m), None) => {
            let format =
                tools.ok_or_else(|| bad("this model's template has no tool-call syntax"))?;
            let g = grammars(&s)?;
            Some(structured::tool_grammar(g, format, &parsed_tools, m)?)
        }
        (None, spec) => spec,
    };
    let constraint = match spec {
        Some(spec) => {
            if thinking {
                // a constrained answer has no reasoning part: the turn's `<think>` is closed
                // (as the templates do with thinking off)
                prompt.extend(s.tok.encode("</think>").map_err(|e| bad(e.to_string()))?);
                thinking = false;
            }
            Some(constraint(&s, &spec)?)
        }
        None => None,
    };
    answer(
        s,
        vec![Prompted {
            ids: prompt,
            echo: None,
        }],
        set,
        Some(ChatMode { thinking, tools }),
        constraint,
    )
    .await
}

/// The message of a whole answer: reasoning apart, tool calls taken out; and its finish reason
/// given the generation's: `tool_calls` where it called tools, but the generation's own where
/// it ended inside a call (`length` when `max_tokens` cut it; the cut call is left out).
fn chat_message(
    content: String,
    reasoning: String,
    tools: Option<ToolFormat>,
    id: &str,
    finish: &'static str,
) -> (Json, &'static str) {
    let (content, calls, cut) = match tools {
        Some(f) => {
            let e = f.extract(&content);
            (e.content, e.calls, e.cut)
        }
        None => (content, vec![], false),
    };
    let mut msg = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        msg["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        msg["tool_calls"] = calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": format!("call_{id}_{i}"), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments.to_string()}})
            })
            .collect();
    }
    let finish = if !cut && !calls.is_empty() {
        "tool_calls"
    } else {
        finish
    };
    (msg, finish)
}

/// What one choice of a streamed answer has sent so far.
struct ChoiceStream {
    split: Reasoning,
    /// The role is still to be sent (chat).
    first: bool,
    /// Content held back while tool calls are read from the whole answer.
    held_content: String,
    /// Log probabilities of the tokens behind the next piece of text.
    pending_lp: Vec<TokenLogprob>,
    done: bool,
}

/// Queues a generation (its `n` choices per prompt, each prompt its own sequence of the batch)
/// and answers with its result or its stream (OpenAI shapes). Choice `p * n + j` is prompt
/// `p`'s `j`-th (vLLM's order). A prompt's `echo` text comes back before each of its choices'
/// completions (with its log probabilities when they are asked for; the first token's is
/// null). Usage sums the prompts (each once) and every choice's completion.
async fn answer(
    s: Arc<Shared>,
    prompts: Vec<Prompted>,
    set: Settings,
    mode: Option<ChatMode>,
    constraint: Option<Constraint>,
) -> Result<Response, ApiError> {
    let chat = mode.is_some();
    let tools = mode.and_then(|m| m.tools);
    let thinking = mode.is_some_and(|m| m.thinking);
    let n = set.n.max(1);
    let firsts: Vec<u32> = prompts
        .iter()
        .map(|p| p.ids.first().copied().unwrap_or(0))
        .collect();
    let (ids, echoes): (Vec<_>, Vec<_>) = prompts.into_iter().map(|p| (p.ids, p.echo)).unzip();
    let echo = echoes.iter().any(Option::is_some);
    let prompt_lp = echo.then(|| set.logprobs.unwrap_or(0));
    let rxs: Vec<_> = submit_all(&s, ids, &set, prompt_lp, constraint)?
        .into_iter()
        .flatten()
        .collect();
    let id = format!(
        "{}-{}",
        if chat { "chatcmpl" } else { "cmpl" },
        s.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let (created, model) = (now(), s.opts.model_name.clone());
    let echoed = move |p: Vec<TokenLogprob>| -> Vec<Option<TokenLogprob>> {
        std::iter::once(None)
            .chain(p.into_iter().map(Some))
            .collect()
    };
    if !set.stream {
        let mut choices = Vec::new();
        let (mut prompt_tokens, mut completion, mut drafted, mut accepted) = (0, 0, 0, 0);
        for (index, rx) in rxs.into_iter().enumerate() {
            let ans = whole(rx).await?;
            if index % n == 0 {
                prompt_tokens += ans.prompt_tokens;
            }
            completion += ans.completion_tokens;
            drafted += ans.drafted;
            accepted += ans.accepted;
            let choice = if chat {
                let mut split = Reasoning::new(thinking);
                let (r, c) = split.push(&ans.text);
                let (r2, c2) = split.end();
                let (msg, finish) = chat_message(c + &c2, r + &r2, tools, &id, ans.finish);
                let lp = set
                    .logprobs
                    .map(|_| chat_logprobs(&s.tok, &ans.logprobs))
                    .unwrap_or(Json::Null);
                json!({"index": index, "message": msg, "finish_reason": finish, "logprobs": lp})
            } else {
                let mut lps: Vec<Option<TokenLogprob>> = Vec::new();
                let mut text = ans.text;
                let p = index / n;
                if let Some(e) = &echoes[p] {
                    text = e.clone() + &text;
                    lps.append(&mut echoed(ans.prompt_logprobs));
                }
                lps.extend(ans.logprobs.into_iter().map(Some));
                let first = echoes[p].as_ref().map(|_| firsts[p]);
                let lp = set
                    .logprobs
                    .map(|_| completion_logprobs(&s.tok, &lps, first))
                    .unwrap_or(Json::Null);
                json!({"index": index, "text": text, "finish_reason": ans.finish, "logprobs": lp})
            };
            choices.push(choice);
        }
        return Ok(axum::Json(json!({
            "id": id,
            "object": if chat { "chat.completion" } else { "text_completion" },
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion, drafted, accepted),
        }))
        .into_response());
    }
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let stream_id = id.clone();
    let chunk = move |choice: Json, usage_v: Option<Json>| {
        let mut c = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
        if let Some(u) = usage_v {
            c["choices"] = json!([]);
            c["usage"] = u;
        }
        format!("data: {c}\n\n")
    };
    let mut states: Vec<ChoiceStream> = (0..rxs.len())
        .map(|_| ChoiceStream {
            split: Reasoning::new(thinking),
            first: chat,
            held_content: String::new(),
            pending_lp: Vec::new(),
            done: false,
        })
        .collect();
    let (mut prompt_total, mut completion, mut drafted, mut accepted) = (0, 0, 0, 0);
    let tok = s.tok.clone();
    let want_lp = set.logprobs.is_some();
    let stream = sse(merged(rxs), String::new(), move |(index, ev)| {
        let st = &mut states[index];
        match ev {
            Event::Prompt(p) => {
                // echo: the prompt's text first, with its log probabilities when asked
                let lp = if want_lp {
                    let p = echoed(p);
                    completion_logprobs(&tok, &p, Some(firsts[index / n]))
                } else {
                    Json::Null
                };
                let text = echoes[index / n].clone().unwrap_or_default();
                let choice =
                    json!({"index": index, "text": text, "finish_reason": null, "logprobs": lp});
                (chunk(choice, None), false)
            }
            Event::Logprobs(l) => {
                st.pending_lp = l;
                (String::new(), false)
            }
            Event::Text(t) => {
                let mut lp = if st.pending_lp.is_empty() {
                    Json::Null
                } else {
                    let l = std::mem::take(&mut st.pending_lp);
                    if chat {
                        chat_logprobs(&tok, &l)
                    } else {
                        let l: Vec<_> = l.into_iter().map(Some).collect();
                        completion_logprobs(&tok, &l, None)
                    }
                };
                if !chat {
                    let choice =
                        json!({"index": index, "text": t, "finish_reason": null, "logprobs": lp});
                    return (chunk(choice, None), false);
                }
                let (r, mut c) = st.split.push(&t);
                if tools.is_some() {
                    // tool calls are read from the whole answer: content waits for the end
                    st.held_content += &c;
                    c = String::new();
                }
                let mut out = String::new();
                for (field, piece) in [("reasoning_content", r), ("content", c)] {
                    if piece.is_empty() {
                        continue;
                    }
                    let mut d = json!({ field: piece });
                    if st.first {
                        d["role"] = json!("assistant");
                        st.first = false;
                    }
                    let mut c = json!({"index": index, "delta": d, "finish_reason": null});
                    if !lp.is_null() {
                        c["logprobs"] = std::mem::take(&mut lp);
                    }
                    out += &chunk(c, None);
                }
                (out, false)
            }
            Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                drafted: d,
                accepted: a,
                ..
            } => {
                let mut held = String::new();
                let mut finish = finish;
                if chat {
                    let (r, c) = st.split.end();
                    let mut content = c;
                    let mut calls = Json::Null;
                    if tools.is_some() {
                        let all = std::mem::take(&mut st.held_content) + &content;
                        let (msg, f) = chat_message(all, String::new(), tools, &stream_id, finish);
                        content = msg["content"].as_str().unwrap_or_default().to_string();
                        finish = f;
                        if msg["tool_calls"].is_array() {
                            calls = msg["tool_calls"].clone();
                            if let Some(a) = calls.as_array_mut() {
                                for (i, c) in a.iter_mut().enumerate() {
                                    c["index"] = json!(i);
                                }
                            }
                        }
                    }
                    if !calls.is_null() {
                        let d = json!({"tool_calls": calls});
                        held += &chunk(
                            json!({"index": index, "delta": d, "finish_reason": null}),
                            None,
                        );
                    }
                    for (field, piece) in [("reasoning_content", r), ("content", content)] {
                        if !piece.is_empty() {
                            let d = json!({ field: piece });
                            held += &chunk(
                                json!({"index": index, "delta": d, "finish_reason": null}),
                                None,
                            );
                        }
                    }
                }
                let choice = if chat {
                    json!({"index": index, "delta": {}, "finish_reason": finish})
                } else {
                    json!({"index": index, "text": "", "finish_reason": finish, "logprobs": null})
                };
                st.done = true;
                if index % n == 0 {
                    prompt_total += prompt_tokens;
                }
                completion += completion_tokens;
                drafted += d;
                accepted += a;
                let mut end = held + &chunk(choice, None);
                let all_done = states.iter().all(|c| c.done);
                if all_done {
                    end += &chunk(
                        json!(null),
                        Some(usage(prompt_total, completion, drafted, accepted)),
                    );
                    end += "data: [DONE]\n\n";
                }
                (end, all_done)
            }
            Event::Failed(m) => {
                let e = json!({"error": {"message": m, "type": "server_error", "param": null, "code": null}});
                (format!("data: {e}\n\n"), true)
            }
        }
    });
    Ok(stream)
}

/// Chat's log probabilities: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn chat_logprobs(tok: &TextTokenizer, lps: &[TokenLogprob]) -> Json {
    let text = |t: u32| tok.decode(&[t]).unwrap_or_default();
    let entry = |t: u32, lp: f32| {
        let s = text(t);
        json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
    };
    json!({"content": lps.iter().map(|(t, lp, alt)| {
        let mut e = entry(*t, *lp);
        e["top_logprobs"] = alt.iter().map(|(a, l)| entry(*a, *l)).collect();
        e
    }).collect::<Vec<_>>()})
}

/// Completions' log probabilities: `{tokens, token_logprobs, top_logprobs, text_offset}`. An
/// entry without a log probability (`None`) is the echoed prompt's first token, `first`: its
/// logprob and alternatives are null.
fn completion_logprobs(
    tok: &TextTokenizer,
    lps: &[Option<TokenLogprob>],
    first: Option<u32>,
) -> Json {
    let text = |t: u32| tok.decode(&[t]).unwrap_or_default();
    let token = |e: &Option<TokenLogprob>| match e {
        Some((t, _, _)) => *t,
        None => first.unwrap_or(0),
    };
    let mut offset = 0;
    let offsets: Vec<usize> = lps
        .iter()
        .map(|e| {
            let o = offset;
            offset += text(token(e)).len();
            o
        })
        .collect();
    json!({
        "tokens": lps.iter().map(|e| text(token(e))).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|e| e.as_ref().map(|(_, lp, _)| *lp)).collect::<Vec<_>>(),
        // the top alternatives and, as OpenAI documents (up to `logprobs + 1` entries), the
        // token itself beside them
        "top_logprobs": lps.iter().map(|e| match e {
            Some((t, lp, alt)) => {
                let mut m: serde_json::Map<_, _> =
                    alt.iter().map(|(a, l)| (text(*a), json!(l))).collect();
                if !alt.iter().any(|(a, _)| a == t) {
                    m.insert(text(*t), json!(lp));
                }
                Json::Object(m)
            }
            None => Json::Null,
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}
