//! `POST /tokenize` and `POST /detokenize` (llama-server's names and shapes; `prompt` as vLLM
//! names it is read too): text to the model's token ids and back, nothing generated.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value as Json};

use super::auth::authorized;
use super::error::{bad, ApiError};
use super::request::check_model;
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

/// `POST /tokenize`: `{"content": TEXT, "with_pieces": BOOL}` to `{"tokens": [ID, ...]}` (with
/// pieces: `[{"id", "piece"}]`), plus `count` and the context (`max_model_len`). No special
/// tokens are added (`add_special: true` is refused: this tokenizer adds none).
pub(super) async fn tokenize(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let v = fields(
        &body,
        &["content", "prompt", "model", "with_pieces", "add_special"],
    )?;
    check_model(&s, &v)?;
    let text = match (&v["content"], &v["prompt"]) {
        (Json::String(t), Json::Null) | (Json::Null, Json::String(t)) => t,
        _ => return Err(bad("give the text as `content` (a string)")),
    };
    let flag = |k: &str| match &v[k] {
        Json::Null => Ok(false),
        Json::Bool(b) => Ok(*b),
        _ => Err(bad(format!("`{k}` must be true or false"))),
    };
    if flag("add_special")? {
        return Err(bad(
            "`add_special`: this model's tokenizer adds no special tokens",
        ));
    }
    let ids = s.tok.encode(text).map_err(|e| bad(e.to_string()))?;
    let tokens: Vec<Json> = if flag("with_pieces")? {
        ids.iter()
            .map(|&t| json!({"id": t, "piece": s.tok.decode(&[t]).unwrap_or_default()}))
            .collect()
    } else {
        ids.iter().map(|&t| json!(t)).collect()
    };
    Ok(axum::Json(json!({
        "tokens": tokens,
        "count": ids.len(),
        "max_model_len": s.opts.context,
    }))
    .into_response())
}

/// `POST /detokenize`: `{"tokens": [ID, ...]}` to `{"content": TEXT}` (special tokens shown).
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
    let content = s.tok.decode(&ids).map_err(|e| bad(e.to_string()))?;
    Ok(axum::Json(json!({ "content": content })).into_response())
}
