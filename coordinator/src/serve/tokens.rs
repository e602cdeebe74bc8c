//! The tokenizer's routes, nothing generated, in llama-server's and vLLM's shapes:
//! `POST /tokenize` (text, or a conversation rendered by the chat template, to token ids),
//! `POST /detokenize` (ids back to text) and `GET /tokenizer_info` (the tokenizer's
//! configuration). vLLM's are what lm-evaluation-harness's remote tokenizer reads
//! (`tokenizer_backend=remote`, and `auto` when the server answers them).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value as Json};

use super::auth::authorized;
use super::error::{bad, ApiError};
use super::request::{check_model, Conversation};
use super::settings::parse;
use super::Shared;

/// Reads `known` fields of an object body; anything else is a 400.
fn fields(body: &Bytes, known: &[&str]) -> Result<Json, ApiError> {
    let v = parse(body)?;
    let Some(o) = v.as_object() else {
        return Err(bad("the body must be a JSON object"));
    };
    if let Some(k) = o.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(bad(format!("unknown field `{k}`")));
    }
    Ok(v)
}

/// `POST /tokenize`, in either server's shape:
/// - llama-server's `{"content": TEXT, "with_pieces": BOOL}`: `tokens` as ids (with pieces:
///   `[{"id", "piece"}]`); no special tokens are added (`add_special: true` is refused).
/// - vLLM's `{"prompt": TEXT, "add_special_tokens": BOOL}` (default true: what the tokenizer's
///   post-processor adds, if anything) or `{"messages": [...], "add_generation_prompt": BOOL,
///   "add_special_tokens": BOOL, "tools", "chat_template_kwargs"}` (the conversation rendered by
///   the chat template as `/v1/chat/completions` renders it; default: the assistant's turn
///   opened, no special tokens added), with `"return_token_strs": true` the tokens' vocabulary
///   strings as `token_strs`.
///
/// Both answer `tokens`, `count` and the context (`max_model_len`).
pub(super) async fn tokenize(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let v = fields(
        &body,
        &[
            "content",
            "prompt",
            "messages",
            "model",
            "with_pieces",
            "add_special",
            "add_special_tokens",
            "return_token_strs",
            "add_generation_prompt",
            "continue_final_message",
            "tools",
            "chat_template_kwargs",
        ],
    )?;
    check_model(&s, &v)?;
    let flag = |k: &str, default: bool| match &v[k] {
        Json::Null => Ok(default),
        Json::Bool(b) => Ok(*b),
        _ => Err(bad(format!("`{k}` must be true or false"))),
    };
    if flag("add_special", false)? {
        return Err(bad(
            "`add_special`: this model's tokenizer adds no special tokens",
        ));
    }
    if flag("continue_final_message", false)? {
        return Err(bad("`continue_final_message` is not supported"));
    }
    let (text, add_special) = match (&v["content"], &v["prompt"], &v["messages"]) {
        (Json::String(t), Json::Null, Json::Null) | (Json::Null, Json::String(t), Json::Null) => {
            // (vLLM adds the tokenizer's special tokens to a prompt unless told not to)
            let vllm = v["prompt"].is_string();
            (t.clone(), flag("add_special_tokens", vllm)?)
        }
        (Json::Null, Json::Null, Json::Array(_)) => (
            rendered(&s, &body, flag("add_generation_prompt", true)?)?,
            flag("add_special_tokens", false)?,
        ),
        _ => {
            return Err(bad(
                "give one of `prompt` or `content` (a string) or `messages` (a list)",
            ))
        }
    };
    let ids = s
        .tok
        .inner()
        .encode(text.as_str(), add_special)
        .map_err(|e| bad(e.to_string()))?
        .get_ids()
        .to_vec();
    let tokens: Vec<Json> = if flag("with_pieces", false)? {
        ids.iter()
            .map(|&t| json!({"id": t, "piece": s.tok.decode(&[t]).unwrap_or_default()}))
            .collect()
    } else {
        ids.iter().map(|&t| json!(t)).collect()
    };
    let mut out = json!({
        "tokens": tokens,
        "count": ids.len(),
        "max_model_len": s.opts.context,
    });
    if flag("return_token_strs", false)? {
        out["token_strs"] = ids
            .iter()
            .map(|&t| json!(s.tok.inner().id_to_token(t).unwrap_or_default()))
            .collect();
    }
    Ok(axum::Json(out).into_response())
}

/// The text of the conversation in `body` (`messages`, `tools`, `chat_template_kwargs`) as the
/// chat template renders it for `/v1/chat/completions`.
fn rendered(s: &Shared, body: &Bytes, add_generation_prompt: bool) -> Result<String, ApiError> {
    let Some(t) = &s.template else {
        return Err(bad("this model has no chat template: give `prompt`"));
    };
    // the template sees the messages in their key order
    let v: minijinja::Value = serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
    let tools = v
        .get_attr("tools")
        .is_ok_and(|t| !t.is_undefined() && !t.is_none());
    Conversation::openai(&v, t, tools)?.text(t, add_generation_prompt)
}

/// `POST /detokenize`: `{"tokens": [ID, ...]}` to the text (special tokens shown), as
/// llama-server names it (`content`) and as vLLM does (`prompt`).
pub(super) async fn detokenize(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let v = fields(&body, &["tokens", "model"])?;
    check_model(&s, &v)?;
    let ids: Option<Vec<u32>> = v["tokens"].as_array().and_then(|a| {
        a.iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    });
    let Some(ids) = ids else {
        return Err(bad("`tokens` must be a list of token ids"));
    };
    s.tok.check_ids(&ids).map_err(|e| bad(e.to_string()))?;
    let text = s.tok.decode(&ids).map_err(|e| bad(e.to_string()))?;
    Ok(axum::Json(json!({ "content": text, "prompt": text })).into_response())
}

/// `GET /tokenizer_info` (vLLM's): the tokenizer's configuration (`tokenizer_config.json`
/// without its file paths, added tokens as their text), `tokenizer_class`, the chat template
/// the server renders, and `eos_token` where the configuration has none (the first
/// end-of-sequence id's text).
pub(super) async fn tokenizer_info(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let mut c = match &s.opts.tokenizer_config {
        Json::Object(o) => o.clone(),
        _ => serde_json::Map::new(),
    };
    c.remove("vocab_file");
    c.remove("merges_file");
    if !c.get("tokenizer_class").is_some_and(Json::is_string) {
        c.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    }
    if !c.get("eos_token").is_some_and(Json::is_string) {
        if let Some(t) = s.stop_ids.first().and_then(|&t| s.tok.decode(&[t]).ok()) {
            c.insert("eos_token".into(), json!(t));
        }
    }
    Ok(axum::Json(Json::Object(c)).into_response())
}
