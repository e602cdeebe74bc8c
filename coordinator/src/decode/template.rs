//! Chat templates: a model's Hugging Face Jinja template rendered as transformers renders it
//! (`render_jinja_template`), so that a conversation becomes the same prompt text.
//!
//! The environment reproduces transformers' sandbox where the output depends on it: trim and
//! lstrip blocks, template line endings turned into LF and one trailing newline dropped, loop
//! controls, the `{% generation %}` block (rendered as its body), `raise_exception`,
//! `strftime_now`, Python string and dict methods (`startswith`, `split`, `items()`, ...), a
//! `tojson` that writes what `json.dumps(ensure_ascii=False)` writes (`", "` and `": "`
//! separators, keys in their given order, no HTML escaping), and Python's printing of values
//! (`None`, `True`, `False`). Lists and maps are immutable, as in the sandbox. Messages keep
//! their key order (parse requests into [`Value`] directly, not through a sorted map).
//!
//! One known difference: Jinja2 refuses to loop over a null value, this renderer loops over
//! nothing. [`drop_null_keys`] (what `apply_chat_template` does first) avoids the case.

use std::path::Path;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

/// Why a template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{path}: {why}")]
    Load { path: String, why: String },
    #[error("chat template: {0}")]
    Render(String),
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// How the template teaches the model to call tools, if it does in a known way.
    pub tool_format: Option<crate::decode::tool_calls::ToolFormat>,
}

/// What a template is rendered with.
#[derive(Debug, Clone, Default)]
pub struct ChatInput {
    /// The conversation: a list of message maps.
    pub messages: Value,
    /// Tool definitions (none when the request has none).
    pub tools: Value,
    pub add_generation_prompt: bool,
    /// `bos_token` / `eos_token` (left undefined when `None`).
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Further template variables (`enable_thinking`, `reasoning_effort`, ...).
    pub kwargs: Vec<(String, Value)>,
}

impl ChatTemplate {
    /// Compiles template source `source`.
    pub fn new(source: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| ChatError::Render(e.to_string()))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", |m: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, m))
        });
        env.add_function("strftime_now", |f: String| -> Result<Value, Error> {
            Ok(Value::from(strftime_now(&f)))
        });
        env.add_filter("tojson", tojson);
        // Python's None is not iterable (minijinja would loop over it as over nothing)
        env.add_test("iterable", |v: Value| {
            v.kind() != ValueKind::None && v.try_iter().is_ok()
        });
        let src = normalize(source);
        let tool_format = crate::decode::tool_calls::ToolFormat::of_template(&src);
        env.add_template_owned("chat", src)
            .map_err(|e| ChatError::Render(e.to_string()))?;
        Ok(Self { env, tool_format })
    }

    /// The template of a model directory: `chat_template.jinja`, else `tokenizer_config.json`'s
    /// `chat_template` (a string, or a list of named templates: the one named `default`).
    /// `Ok(None)` when the model has none.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, ChatError> {
        let load = |p: &Path, why: String| ChatError::Load {
            path: p.display().to_string(),
            why,
        };
        let j = dir.join("chat_template.jinja");
        if j.is_file() {
            let s = std::fs::read_to_string(&j).map_err(|e| load(&j, e.to_string()))?;
            return Self::new(&s).map(Some).map_err(|e| load(&j, e.to_string()));
        }
        let c = dir.join("tokenizer_config.json");
        if !c.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&c).map_err(|e| load(&c, e.to_string()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| load(&c, e.to_string()))?;
        let src = match &v["chat_template"] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .ok_or_else(|| load(&c, "no template named `default`".into()))?
                .to_string(),
            serde_json::Value::Null => return Ok(None),
            _ => {
                return Err(load(
                    &c,
                    "`chat_template` is neither text nor a list".into(),
                ))
            }
        };
        Self::new(&src)
            .map(Some)
            .map_err(|e| load(&c, e.to_string()))
    }

    /// Renders a conversation.
    pub fn render(&self, input: &ChatInput) -> Result<String, ChatError> {
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), with_reasoning_aliases(&input.messages)),
            ("tools".into(), input.tools.clone()),
            ("documents".into(), Value::from(())),
            (
                "add_generation_prompt".into(),
                Value::from(input.add_generation_prompt),
            ),
        ];
        if let Some(b) = &input.bos_token {
            ctx.push(("bos_token".into(), Value::from(b.as_str())));
        }
        if let Some(e) = &input.eos_token {
            ctx.push(("eos_token".into(), Value::from(e.as_str())));
        }
        ctx.extend(input.kwargs.iter().cloned());
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Render(e.to_string()))?;
        t.render(Value::from_pairs(ctx))
            .map_err(|e| ChatError::Render(e.to_string()))
    }
}

/// Template source as Jinja2 reads it: CR LF and CR as LF, one trailing newline dropped, and the
/// `{% generation %}` block (transformers' assistant-mask extension) as a plain block with the
/// same whitespace control.
fn normalize(src: &str) -> String {
    let src = src.replace("\r\n", "\n").replace('\r', "\n");
    let src = src.strip_suffix('\n').unwrap_or(&src);
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        let Some(j) = tail.find("%}") else {
            out.push_str(tail);
            return out;
        };
        let tag = &tail[..j + 2];
        let inner = tag[2..tag.len() - 2]
            .trim_matches(|c| c == '-' || c == '+')
            .trim();
        match inner {
            "generation" => out.push_str(&tag.replacen("generation", "if true", 1)),
            "endgeneration" => out.push_str(&tag.replacen("endgeneration", "endif", 1)),
            _ => out.push_str(tag),
        }
        rest = &tail[j + 2..];
    }
    out.push_str(rest);
    out
}

/// Values printed as Python prints them: `None`, `True`, `False`; undefined as nothing.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &mut minijinja::State,
    v: &Value,
) -> Result<(), Error> {
    let w = |out: &mut minijinja::Output, s: &str| {
        std::fmt::Write::write_str(out, s)
            .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
    };
    match v.kind() {
        ValueKind::None => w(out, "None"),
        ValueKind::Bool => w(out, if v.is_true() { "True" } else { "False" }),
        _ => minijinja::escape_formatter(out, state, v),
    }
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=None, sort_keys=sort_keys)`.
fn tojson(v: Value, kw: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kw.get("indent")?;
    let sort_keys: Option<bool> = kw.get("sort_keys")?;
    // (the output is the same text either way for what templates pass)
    let _: Option<bool> = kw.get("ensure_ascii")?;
    let _: Option<Value> = kw.get("separators")?;
    kw.assert_all_used()?;
    let mut s = String::new();
    py_json(&v, indent, 0, sort_keys.unwrap_or(false), &mut s)?;
    Ok(Value::from_safe_string(s))
}

fn py_json(
    v: &Value,
    indent: Option<usize>,
    level: usize,
    sort: bool,
    out: &mut String,
) -> Result<(), Error> {
    let pad = |out: &mut String, l: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * l));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(
            &serde_json::to_string(v)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?,
        ),
        ValueKind::String => out.push_str(
            &serde_json::to_string(v.as_str().unwrap_or_default())
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?,
        ),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                pad(out, level + 1);
                py_json(x, indent, level + 1, sort, out)?;
            }
            pad(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                pad(out, level + 1);
                let name = k
                    .as_str()
                    .map(String::from)
                    .unwrap_or_else(|| k.to_string());
                out.push_str(&serde_json::to_string(&name).unwrap_or_default());
                out.push_str(": ");
                py_json(&v.get_item(k)?, indent, level + 1, sort, out)?;
            }
            pad(out, level);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot write a {} value", v.kind()),
            ))
        }
    }
    Ok(())
}

/// Messages with a reasoning text under `reasoning_content`, `thinking` or `reasoning` get it
/// under both `thinking` and `reasoning_content` (`thinking` first), as transformers does.
fn with_reasoning_aliases(messages: &Value) -> Value {
    let Ok(iter) = messages.try_iter() else {
        return messages.clone();
    };
    if messages.kind() != ValueKind::Seq {
        return messages.clone();
    }
    Value::from(
        iter.map(|m| {
            if m.kind() != ValueKind::Map {
                return m;
            }
            let get = |k: &str| {
                m.get_attr(k)
                    .ok()
                    .filter(|v| !v.is_undefined() && !v.is_none())
            };
            let Some(r) = get("reasoning_content")
                .or_else(|| get("thinking"))
                .or_else(|| get("reasoning"))
            else {
                return m;
            };
            let mut pairs: Vec<(Value, Value)> = vec![(Value::from("thinking"), r.clone())];
            for k in m.try_iter().into_iter().flatten() {
                if matches!(k.as_str(), Some("thinking" | "reasoning_content")) {
                    continue;
                }
                let v = m.get_item(&k).unwrap_or_default();
                pairs.push((k, v));
            }
            pairs.push((Value::from("reasoning_content"), r));
            Value::from_pairs(pairs)
        })
        .collect::<Vec<_>>(),
    )
}

/// `messages` with every top-level message key whose value is null removed (what
/// `apply_chat_template` does before rendering; OpenAI clients send `"content": null` beside
/// tool calls).
pub fn drop_null_keys(messages: &Value) -> Value {
    let Ok(iter) = messages.try_iter() else {
        return messages.clone();
    };
    Value::from(
        iter.map(|m| {
            if m.kind() != ValueKind::Map {
                return m;
            }
            let pairs: Vec<(Value, Value)> = m
                .try_iter()
                .into_iter()
                .flatten()
                .filter_map(|k| {
                    let v = m.get_item(&k).ok()?;
                    (!v.is_none()).then_some((k, v))
                })
                .collect();
            Value::from_pairs(pairs)
        })
        .collect::<Vec<_>>(),
    )
}

/// The local time formatted with C `strftime` format `f`.
fn strftime_now(f: &str) -> String {
    let Ok(cf) = std::ffi::CString::new(f) else {
        return String::new();
    };
    // SAFETY: `time(NULL)` and `localtime_r` with valid pointers; `strftime` writes at most
    // `buf.len()` bytes into `buf` and returns how many.
    unsafe {
        let t = libc::time(std::ptr::null_mut());
        let mut tm = std::mem::zeroed::<libc::tm>();
        if libc::localtime_r(&t, &mut tm).is_null() {
            return String::new();
        }
        let mut buf = vec![0u8; 256];
        let n = libc::strftime(buf.as_mut_ptr().cast(), buf.len(), cf.as_ptr(), &tm);
        buf.truncate(n);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// `messages` with every tool call's `function.arguments` as an object (`as_objects`: GLM's
/// templates iterate them) or as JSON text (DeepSeek's concatenate them), whichever the
/// client sent; other values are kept as they are.
pub fn tool_arguments(messages: &Value, as_objects: bool) -> Value {
    let Ok(iter) = messages.try_iter() else {
        return messages.clone();
    };
    let convert = |args: Value| -> Value {
        match (args.kind(), as_objects) {
            (ValueKind::String, true) => {
                serde_json::from_str::<Value>(args.as_str().unwrap_or_default()).unwrap_or(args)
            }
            (ValueKind::Map, false) => {
                let mut s = String::new();
                match py_json(&args, None, 0, false, &mut s) {
                    Ok(()) => Value::from(s),
                    Err(_) => args,
                }
            }
            _ => args,
        }
    };
    let remap = |m: &Value, f: &dyn Fn(&Value, &Value) -> Value| -> Value {
        Value::from_pairs(
            m.try_iter()
                .into_iter()
                .flatten()
                .map(|k| {
                    let v = m.get_item(&k).unwrap_or_default();
                    (k.clone(), f(&k, &v))
                })
                .collect::<Vec<_>>(),
        )
    };
    Value::from(
        iter.map(|m| {
            if m.kind() != ValueKind::Map {
                return m;
            }
            remap(&m, &|k, v| {
                if k.as_str() != Some("tool_calls") || v.kind() != ValueKind::Seq {
                    return v.clone();
                }
                Value::from(
                    v.try_iter()
                        .into_iter()
                        .flatten()
                        .map(|call| {
                            if call.kind() != ValueKind::Map {
                                return call;
                            }
                            remap(&call, &|k, f| {
                                if k.as_str() != Some("function") || f.kind() != ValueKind::Map {
                                    return f.clone();
                                }
                                remap(f, &|k, a| {
                                    if k.as_str() == Some("arguments") {
                                        convert(a.clone())
                                    } else {
                                        a.clone()
                                    }
                                })
                            })
                        })
                        .collect::<Vec<_>>(),
                )
            })
        })
        .collect::<Vec<_>>(),
    )
}
