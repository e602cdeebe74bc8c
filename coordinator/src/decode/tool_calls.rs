//! Tool calls in generated text, in the formats the chat templates teach the model: taken out of
//! the answer and returned as structured calls (OpenAI's `tool_calls`).
//!
//! - [`ToolFormat::Glm`] (GLM-4.5 and later): `<tool_call>NAME<arg_key>K</arg_key>
//!   <arg_value>V</arg_value>...</tool_call>`, each value JSON text or a plain string.
//! - [`ToolFormat::Hermes`] (Qwen3 and others): `<tool_call>{"name": ..., "arguments": {...}}
//!   </tool_call>`.
//! - [`ToolFormat::DeepSeek`] (DeepSeek-V3.1): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
//!   <｜tool▁call▁end｜>` inside `<｜tool▁calls▁begin｜>` … `<｜tool▁calls▁end｜>`.
//! - [`ToolFormat::Kimi`] (Kimi-K2): `<|tool_call_begin|>functions.NAME:N
//!   <|tool_call_argument_begin|>ARGS<|tool_call_end|>` inside the tool-calls section markers.

use serde_json::{Map, Value};

/// How a template's model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Glm,
    Hermes,
    DeepSeek,
    Kimi,
}

/// An answer's text and calls ([`ToolFormat::extract`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Extracted {
    /// The text outside tool calls, trimmed.
    pub content: String,
    pub calls: Vec<ToolCall>,
    /// The answer ended inside a call, which is in neither.
    pub cut: bool,
}

/// A call taken out of an answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments, an object.
    pub arguments: Value,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const DS: [&str; 5] = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
];
const KIMI: [&str; 5] = [
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
];

impl ToolFormat {
    /// The format a chat template's source teaches, if it teaches one of these.
    pub fn of_template(src: &str) -> Option<Self> {
        if src.contains("<arg_key>") && src.contains(OPEN) {
            Some(Self::Glm)
        } else if src.contains(DS[2]) {
            Some(Self::DeepSeek)
        } else if src.contains(KIMI[2]) {
            Some(Self::Kimi)
        } else if src.contains(OPEN) {
            Some(Self::Hermes)
        } else {
            None
        }
    }

    /// The answer's text outside tool calls (trimmed), and the calls, in order. A closed block
    /// that does not parse stays in the text; a call the answer ends inside (cut by
    /// `max_tokens`, or ended mid-call) is left out of both, and `cut` says so.
    pub fn extract(self, text: &str) -> Extracted {
        match self {
            Self::DeepSeek => return sectioned(text, &DS, |id| id.to_string()),
            // `functions.NAME:INDEX`
            Self::Kimi => {
                return sectioned(text, &KIMI, |id| {
                    let id = id.strip_prefix("functions.").unwrap_or(id);
                    id.rsplit_once(':').map_or(id, |(n, _)| n).to_string()
                })
            }
            Self::Glm | Self::Hermes => {}
        }
        let (mut content, mut calls) = (String::new(), Vec::new());
        let mut rest = text;
        while let Some(i) = rest.find(OPEN) {
            let after = &rest[i + OPEN.len()..];
            let Some(j) = after.find(CLOSE) else {
                // the answer ends inside a call
                content.push_str(&rest[..i]);
                return Extracted {
                    content: content.trim().to_string(),
                    calls,
                    cut: true,
                };
            };
            let body = &after[..j];
            match self.parse(body) {
                Some(c) => {
                    content.push_str(&rest[..i]);
                    calls.push(c);
                }
                None => content.push_str(&rest[..i + OPEN.len() + j + CLOSE.len()]),
            }
            rest = &after[j + CLOSE.len()..];
        }
        content.push_str(rest);
        Extracted {
            content: content.trim().to_string(),
            calls,
            cut: false,
        }
    }

    fn parse(self, body: &str) -> Option<ToolCall> {
        match self {
            Self::DeepSeek | Self::Kimi => None,
            Self::Hermes => {
                let v: Value = serde_json::from_str(body.trim()).ok()?;
                let name = v["name"].as_str()?.to_string();
                let arguments = match &v["arguments"] {
                    Value::Object(_) => v["arguments"].clone(),
                    Value::String(s) => serde_json::from_str(s).ok()?,
                    Value::Null => Value::Object(Map::new()),
                    _ => return None,
                };
                Some(ToolCall { name, arguments })
            }
            Self::Glm => {
                let (name, mut rest) = match body.find("<arg_key>") {
                    Some(i) => (body[..i].trim(), &body[i..]),
                    None => (body.trim(), ""),
                };
                if name.is_empty() {
                    return None;
                }
                let mut args = Map::new();
                while !rest.trim().is_empty() {
                    let r = rest.trim_start().strip_prefix("<arg_key>")?;
                    let (k, r) = r.split_once("</arg_key>")?;
                    let r = r.trim_start().strip_prefix("<arg_value>")?;
                    let (v, r) = r.split_once("</arg_value>")?;
                    let value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.into()));
                    args.insert(k.trim().to_string(), value);
                    rest = r;
                }
                Some(ToolCall {
                    name: name.to_string(),
                    arguments: Value::Object(args),
                })
            }
        }
    }
}

/// Calls written as `[section open] (call open) NAME-OR-ID (separator) ARGS (call close) ...
/// [section close]` (markers `m`); `name` turns what precedes the separator into the tool name.
/// A closed section that does not parse stays text; an answer that ends inside the section keeps
/// the calls completed in it and leaves the rest out (`cut`).
fn sectioned(text: &str, m: &[&str; 5], name: impl Fn(&str) -> String) -> Extracted {
    let whole = |t: &str| Extracted {
        content: t.trim().to_string(),
        calls: vec![],
        cut: false,
    };
    // the calls of a section; `open`: it has no close, so an unfinished last call ends it
    let parse = |section: &str, open: bool| -> Option<Vec<ToolCall>> {
        let mut calls = Vec::new();
        let mut rest = section;
        while let Some(i) = rest.find(m[1]) {
            let after = &rest[i + m[1].len()..];
            let Some((head, tail)) = after.split_once(m[2]) else {
                return open.then_some(calls);
            };
            let Some((args, next)) = tail.split_once(m[3]) else {
                return open.then_some(calls);
            };
            let arguments: Value = serde_json::from_str(args.trim()).ok()?;
            if !arguments.is_object() {
                return None;
            }
            calls.push(ToolCall {
                name: name(head.trim()),
                arguments,
            });
            rest = next;
        }
        (open || !calls.is_empty()).then_some(calls)
    };
    let Some(start) = text.find(m[0]) else {
        return whole(text);
    };
    let body_end = text[start..].find(m[4]).map(|j| start + j);
    let section = &text[start + m[0].len()..body_end.unwrap_or(text.len())];
    match (parse(section, body_end.is_none()), body_end) {
        (Some(calls), Some(j)) if !calls.is_empty() => {
            let content = format!("{}{}", &text[..start], &text[j + m[4].len()..]);
            Extracted {
                content: content.trim().to_string(),
                calls,
                cut: false,
            }
        }
        (Some(calls), None) => Extracted {
            content: text[..start].trim().to_string(),
            calls,
            cut: true,
        },
        _ => whole(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn glm_calls_come_out_with_typed_arguments() {
        let t = "Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>now</tool_call>";
        let Extracted { content, calls, .. } = ToolFormat::Glm.extract(t);
        assert_eq!(content, "Let me look.");
        assert_eq!(
            calls,
            vec![
                ToolCall {
                    name: "get_weather".into(),
                    arguments: json!({"city": "Paris", "days": 3})
                },
                ToolCall {
                    name: "now".into(),
                    arguments: json!({})
                },
            ]
        );
        // a broken block stays text
        let e = ToolFormat::Glm.extract("a <tool_call>x<arg_key>k</tool_call> b");
        assert!(e.calls.is_empty() && !e.cut);
        assert_eq!(e.content, "a <tool_call>x<arg_key>k</tool_call> b");
        // a call the answer ends inside: the complete ones come out, the cut one nowhere
        let e = ToolFormat::Glm.extract(
            "Here.<tool_call>now</tool_call>\n<tool_call>summon<arg_key>who</arg_key><arg_value>Gho",
        );
        assert_eq!((e.content.as_str(), e.cut), ("Here.", true));
        assert_eq!(e.calls.len(), 1);
        assert_eq!(e.calls[0].name, "now");
    }

    #[test]
    fn hermes_calls_come_out_and_templates_say_their_format() {
        let t = "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"rust\", \"n\": 2}}\n</tool_call>\nDone.";
        let Extracted { content, calls, .. } = ToolFormat::Hermes.extract(t);
        assert_eq!(content, "Done.");
        assert_eq!(calls[0].name, "search");
        assert_eq!(calls[0].arguments, json!({"q": "rust", "n": 2}));
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/templates");
        let fmt = |n: &str| ToolFormat::of_template(&std::fs::read_to_string(dir.join(n)).unwrap());
        assert_eq!(fmt("GLM-5.2.jinja"), Some(ToolFormat::Glm));
        assert_eq!(fmt("GLM-4.6.jinja"), Some(ToolFormat::Glm));
        assert_eq!(fmt("Qwen-Qwen3-0.6B.jinja"), Some(ToolFormat::Hermes));
        assert_eq!(
            fmt("deepseek-ai-DeepSeek-V3.1.jinja"),
            Some(ToolFormat::DeepSeek)
        );
        assert_eq!(fmt("Kimi-K2-Instruct.jinja"), Some(ToolFormat::Kimi));
        assert_eq!(fmt("moonshotai-Kimi-K2.jinja"), None);
        // an unfinished block is cut, not text
        let e = ToolFormat::Hermes.extract("Hi <tool_call>{");
        assert_eq!((e.content.as_str(), e.calls.len(), e.cut), ("Hi", 0, true));
    }

    #[test]
    fn deepseek_and_kimi_calls_come_out() {
        let t = "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let Extracted {
            content,
            calls,
            cut,
        } = ToolFormat::DeepSeek.extract(t);
        assert!(!cut);
        assert_eq!(content, "Sure.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, json!({"city": "Paris"}));
        assert_eq!(calls[1].name, "now");
        let k = "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{\"q\": \"x\"}<|tool_call_end|><|tool_calls_section_end|>";
        let Extracted { content, calls, .. } = ToolFormat::Kimi.extract(k);
        assert_eq!(content, "");
        assert_eq!(calls[0].name, "search");
        assert_eq!(calls[0].arguments, json!({"q": "x"}));
        // arguments that are not an object: the text stays
        let bad = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]<|tool_call_end|><|tool_calls_section_end|>";
        assert!(ToolFormat::Kimi.extract(bad).calls.is_empty());
        // cut inside the section: the complete call comes out, the rest nowhere
        let cut = &t[..t.find("now").unwrap()];
        let e = ToolFormat::DeepSeek.extract(cut);
        assert_eq!(
            (e.content.as_str(), e.calls.len(), e.cut),
            ("Sure.", 1, true)
        );
    }
}
