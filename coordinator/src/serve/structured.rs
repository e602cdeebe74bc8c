//! Structured output: the request fields that constrain an answer, read into one grammar.
//!
//! - OpenAI's `response_format`: `{"type": "json_object"}`, `{"type": "json_schema",
//!   "json_schema": {"schema": ..., "strict": ...}}` (`{"type": "text"}`: none).
//! - `tool_choice` `"required"` or `{"type": "function", "function": {"name": ...}}` (Anthropic's
//!   `{"type": "any"}` / `{"type": "tool", "name": ...}`): the answer is tool calls in the chat
//!   template's own syntax, arguments valid under each tool's parameter schema.
//! - Extensions, with vLLM's names: `guided_json` (a schema), `guided_regex`, `guided_grammar`
//!   (llguidance's Lark, or GBNF when it has `::=` rules), `guided_choice` (one of the strings);
//!   and llama-server's: `json_schema`, `grammar` (GBNF or Lark).
//!
//! A schema's objects that leave `additionalProperties` unset are closed (OpenAI's strict
//! reading, vLLM's and llama.cpp's): the answer has the keys the schema names and no others.

use serde_json::{json, Value as Json};

use super::error::{bad, ApiError};
use crate::decode::grammar::{close_objects, json_layout, GrammarSpec, Grammars};
use crate::decode::tool_calls::ToolFormat;

/// The extension fields this module reads (the handlers take them out of the shared checks).
pub(super) const FIELDS: &[&str] = &[
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
    "json_schema",
    "grammar",
];

/// The grammar the body's structured-output fields ask for, if any (at most one may be given).
pub(super) fn requested(body: &Json) -> Result<Option<GrammarSpec>, ApiError> {
    let given: Vec<&str> = FIELDS
        .iter()
        .copied()
        .filter(|k| !body[*k].is_null())
        .filter(|k| !(*k == "response_format" && body[*k]["type"] == "text"))
        .collect();
    if given.len() > 1 {
        return Err(bad(format!(
            "give one of {}, not several",
            given
                .iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let Some(&k) = given.first() else {
        return Ok(None);
    };
    let v = &body[k];
    let text = |what: &str| {
        v.as_str()
            .map(String::from)
            .ok_or_else(|| bad(format!("`{k}` must be {what}")))
    };
    let schema = |s: &Json| match s {
        Json::Object(_) | Json::Bool(_) => Ok(s.clone()),
        Json::String(t) => serde_json::from_str(t).map_err(|e| bad(format!("`{k}`: {e}"))),
        _ => Err(bad(format!("`{k}` must be a JSON schema"))),
    };
    Ok(Some(match k {
        "response_format" => match v["type"].as_str() {
            Some("json_object") => GrammarSpec::JsonSchema {
                schema: json!({"type": "object"}),
                strict: false,
            },
            Some("json_schema") => {
                let js = &v["json_schema"];
                if js["schema"].is_null() {
                    return Err(bad("`response_format.json_schema.schema` is required"));
                }
                GrammarSpec::JsonSchema {
                    schema: closed(schema(&js["schema"])?),
                    strict: js["strict"].as_bool().unwrap_or(false),
                }
            }
            _ => {
                return Err(bad(
                    "`response_format.type` must be text, json_object or json_schema",
                ))
            }
        },
        "guided_json" | "json_schema" => GrammarSpec::JsonSchema {
            schema: closed(schema(v)?),
            strict: false,
        },
        "guided_regex" => GrammarSpec::Regex(text("a regular expression")?),
        "guided_grammar" | "grammar" => {
            let g = text("a grammar (Lark or GBNF)")?;
            GrammarSpec::Lark(if g.contains("::=") {
                gbnf_to_lark(&g).map_err(|e| bad(format!("`{k}`: {e}")))?
            } else {
                g
            })
        }
        "guided_choice" => {
            let choices: Option<Vec<&str>> = v
                .as_array()
                .map(|a| a.iter().map(|c| c.as_str()).collect::<Option<_>>())
                .unwrap_or(None);
            match choices.filter(|c| !c.is_empty()) {
                Some(c) => GrammarSpec::Lark(format!(
                    "start: {}",
                    c.iter()
                        .map(|s| Json::String(s.to_string()).to_string())
                        .collect::<Vec<_>>()
                        .join(" | ")
                )),
                None => return Err(bad("`guided_choice` must be a list of strings")),
            }
        }
        _ => unreachable!("every field of FIELDS is read above"),
    }))
}

/// `schema` with its objects closed where it leaves `additionalProperties` unset
/// ([`close_objects`]).
fn closed(mut schema: Json) -> Json {
    close_objects(&mut schema);
    schema
}

/// Which tools an answer must call: one or more of any of them (`required`), exactly one of any
/// (`required` with `parallel_tool_calls: false`, Anthropic's `disable_parallel_tool_use`), or
/// the one named (once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum MustCall {
    Any,
    One,
    Named(String),
}

/// The grammar of an answer that is tool calls (one or more for [`MustCall::Any`], one for a
/// named tool) in `format`, each tool's arguments valid under its schema (no arguments beyond
/// its properties, nor keys beyond a nested object's, unless the schema sets
/// `additionalProperties`). `tools`: OpenAI's
/// `[{type: function, function: {name, parameters}}]`.
pub(super) fn tool_grammar(
    g: &Grammars,
    format: ToolFormat,
    tools: &Json,
    must: &MustCall,
) -> Result<GrammarSpec, ApiError> {
    let list = tools.as_array().cloned().unwrap_or_default();
    let mut calls = Vec::new();
    for t in &list {
        let f = &t["function"];
        let Some(name) = f["name"].as_str() else {
            return Err(bad("each tool needs `function.name`"));
        };
        if let MustCall::Named(n) = must {
            if n != name {
                continue;
            }
        }
        let mut params = match &f["parameters"] {
            Json::Null => json!({"type": "object"}),
            p => p.clone(),
        };
        // a call names the tool's parameters only (and each object in them its properties
        // only), unless its schema allows more
        if let Json::Object(o) = &mut params {
            o.entry("additionalProperties").or_insert(Json::Bool(false));
        }
        close_objects(&mut params);
        calls.push((name.to_string(), params));
    }
    if calls.is_empty() {
        return Err(bad(match must {
            MustCall::Named(n) => format!("`tool_choice` names `{n}`, which is not in `tools`"),
            MustCall::Any | MustCall::One => {
                "`tool_choice` requires a call but `tools` is empty".into()
            }
        }));
    }
    let mut rules = Vec::new();
    for (i, (name, params)) in calls.iter().enumerate() {
        let body = match format {
            ToolFormat::Hermes => {
                let schema = json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                });
                format!("\"\\n\" %json {} \"\\n\"", json_layout(&schema, false))
            }
            ToolFormat::Glm => {
                // <arg_key>K</arg_key><arg_value>V</arg_value> per property, in schema order;
                // a string value is written bare (no quotes), anything else as JSON
                let props = params["properties"].as_object().cloned().unwrap_or_default();
                let required: Vec<&str> = params["required"]
                    .as_array()
                    .map(|r| r.iter().filter_map(|x| x.as_str()).collect())
                    .unwrap_or_default();
                let mut parts = vec![Json::String(name.clone()).to_string()];
                for (k, p) in &props {
                    let strings: Option<Vec<String>> = p["enum"].as_array().and_then(|e| {
                        e.iter()
                            .map(|x| x.as_str().map(|x| Json::String(x.into()).to_string()))
                            .collect()
                    });
                    let value = match strings {
                        Some(alts) if !alts.is_empty() => format!("({})", alts.join(" | ")),
                        _ if p["type"] == "string" => {
                            // bare text up to the next tag, within the schema's length bounds
                            let min = p["minLength"].as_u64().unwrap_or(0);
                            match p["maxLength"].as_u64() {
                                Some(max) => format!("/[^<]{{{min},{max}}}/"),
                                None => format!("/[^<]{{{min},}}/"),
                            }
                        }
                        _ => format!("%json {}", json_layout(p, false)),
                    };
                    let arg = format!(
                        "{} {} {} {} {} {}",
                        g.literal("<arg_key>"),
                        Json::String(k.clone()),
                        g.literal("</arg_key>"),
                        g.literal("<arg_value>"),
                        value,
                        g.literal("</arg_value>")
                    );
                    parts.push(if required.contains(&k.as_str()) {
                        arg
                    } else {
                        format!("({arg})?")
                    });
                }
                parts.join(" ")
            }
            ToolFormat::DeepSeek | ToolFormat::Kimi => {
                return Err(bad(
                    "`tool_choice` required or named is supported for GLM and Hermes (Qwen) tool-call templates",
                ))
            }
        };
        rules.push(format!(
            "call{i}: {} {body} {}",
            g.literal("<tool_call>"),
            g.literal("</tool_call>")
        ));
    }
    let call = (0..calls.len())
        .map(|i| format!("call{i}"))
        .collect::<Vec<_>>()
        .join(" | ");
    let start = match must {
        MustCall::Any => "start: call (\"\\n\"? call)*",
        MustCall::One | MustCall::Named(_) => "start: call",
    };
    Ok(GrammarSpec::Lark(format!(
        "{start}\ncall: {call}\n{}\n",
        rules.join("\n")
    )))
}

/// A GBNF grammar (llama.cpp's) in llguidance's Lark dialect: `root` becomes `start`, rule
/// names are made Lark names, character classes become regular expressions; literals,
/// grouping, alternation and the `* + ? {m,n}` repetitions carry over.
pub(super) fn gbnf_to_lark(src: &str) -> Result<String, String> {
    let name = |n: &str| -> String {
        if n == "root" {
            "start".into()
        } else {
            format!("r_{}", n.replace('-', "_").to_lowercase())
        }
    };
    let mut out = String::new();
    let chars: Vec<char> = src.chars().collect();
    let mut i = 0;
    let mut rules = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '"' => {
                let start = i;
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
                if i >= chars.len() {
                    return Err("a string literal is not closed".into());
                }
                out.extend(&chars[start..=i]);
                i += 1;
            }
            '[' => {
                let start = i;
                i += 1;
                while i < chars.len() && chars[i] != ']' {
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
                if i >= chars.len() {
                    return Err("a character class is not closed".into());
                }
                let class: String = chars[start..=i].iter().collect();
                out += &format!("/{}/", class.replace('/', "\\/"));
                i += 1;
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '-' || chars[i] == '_')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                // a rule definition: NAME ::=
                let mut j = i;
                while j < chars.len() && (chars[j] == ' ' || chars[j] == '\t') {
                    j += 1;
                }
                if chars[j..].starts_with(&[':', ':', '=']) {
                    if rules > 0 {
                        out.push('\n');
                    }
                    rules += 1;
                    out += &format!("{}:", name(&word));
                    i = j + 3;
                } else if word.chars().all(|c| c.is_ascii_digit()) {
                    out += &word;
                } else {
                    out += &name(&word);
                }
            }
            '\n' | '\r' => {
                out.push(' ');
                i += 1;
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    if !out.contains("start:") {
        return Err("a GBNF grammar needs a `root` rule".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::gbnf_to_lark;

    #[test]
    fn gbnf_rules_become_lark_rules() {
        let g = "root ::= answer # the whole\nanswer ::= \"yes\" | \"no\" | digit-run\ndigit-run ::= [0-9]+ (\",\" [0-9]{1,3})*\n";
        let l = gbnf_to_lark(g).unwrap();
        assert!(l.starts_with("start: r_answer"), "{l}");
        assert!(
            l.contains("\nr_answer: \"yes\" | \"no\" | r_digit_run"),
            "{l}"
        );
        assert!(
            l.contains("r_digit_run: /[0-9]/+ (\",\" /[0-9]/{1,3})*"),
            "{l}"
        );
        assert!(gbnf_to_lark("a ::= \"x\"").is_err());
        assert!(gbnf_to_lark("root ::= \"x").is_err());
    }
}
