//! Constrained decoding with `llguidance`: a grammar (a JSON schema, a Lark grammar, a regex)
//! becomes a per-token mask applied to the logits before sampling, so every answer parses.
//!
//! [`Grammars`] is built once per tokenizer (the token trie and llguidance's parser factory);
//! each constrained generation gets a [`Constraint`] of its own. After each token the constraint
//! also knows the tokens the grammar forces next ([`Constraint::forced`]: braces, quotes, key
//! names), which the scheduler verifies as drafts in the same forward step.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use charm_shared::par;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use super::tokenizer::TextTokenizer;

/// What a generation is constrained to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Text that is one JSON value valid under the schema, laid out as Python's `json.dumps`
    /// does unless the schema's `x-guidance` options say otherwise. `strict`: keywords the
    /// matcher cannot enforce are refused (otherwise ignored).
    JsonSchema { schema: Value, strict: bool },
    /// A grammar in llguidance's Lark dialect (`start` is the whole answer; `%json {...}` embeds
    /// a schema; `<[ID]>` is one special token).
    Lark(String),
    /// A regular expression the whole answer matches.
    Regex(String),
}

/// The tokenizer as llguidance sees it: each id's bytes (special tokens marked apart, so text
/// never matches them), and the canonical tokenization of forced bytes.
struct TokenizerBridge {
    tok: tokenizers::Tokenizer,
    trie: TokTrie,
}

impl TokenizerEnv for TokenizerBridge {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tok
                .encode(s, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// The grammar machinery of one model: its token trie and llguidance's parser factory (built
/// once: about 0.4 s for a 150k vocabulary; a constraint then costs about a millisecond).
pub struct Grammars {
    factory: Arc<ParserFactory>,
    /// Added tokens by their text (a tool-call marker that is one special token).
    special: Vec<(String, u32)>,
    /// The tokens that end a generation.
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

impl Grammars {
    /// The grammar machinery for `tok`, whose logits have `vocab` rows (the model's; past the
    /// tokenizer's ids they are never allowed) and whose generations end at `stop_ids` (the
    /// first is the primary end-of-sequence token).
    pub fn new(tok: &TextTokenizer, vocab: usize, stop_ids: &[u32]) -> Result<Self, String> {
        let json: Value =
            serde_json::from_str(&tok.inner().to_string(false).map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| format!("the tokenizer cannot drive a grammar: {e}"))?;
        let mut special = Vec::new();
        for a in json["added_tokens"].as_array().into_iter().flatten() {
            let (Some(id), Some(c)) = (a["id"].as_u64(), a["content"].as_str()) else {
                continue;
            };
            let id = id as usize;
            // added tokens shaped like markup (`<think>`, `<tool_call>`) never match plain text
            if id < words.len()
                && c.starts_with('<')
                && c.ends_with('>')
                && words[id].first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER)
            {
                words[id].insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
            special.push((c.to_string(), id as u32));
        }
        if words.len() > vocab {
            return Err(format!(
                "the tokenizer has {} tokens, the model's head {vocab}",
                words.len()
            ));
        }
        while words.len() < vocab {
            let mut w = format!(".<[{}]>", words.len()).into_bytes();
            w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(w);
        }
        let eos: Vec<u32> = stop_ids
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        let first = eos.first().copied().unwrap_or(0);
        let trie =
            TokTrie::from(&TokRxInfo::new(vocab as u32, first), &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(TokenizerBridge {
            tok: tok.inner().clone(),
            trie,
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.set_stderr_log_level(0);
        factory.limits_mut().verbose_errors = false;
        Ok(Self {
            factory: Arc::new(factory),
            special,
            eos: eos.into(),
        })
    }

    /// `text` as a Lark literal: the one special token it names (`<[ID]>`) when the tokenizer has
    /// one with exactly that text, else the quoted string.
    pub fn literal(&self, text: &str) -> String {
        match self.special.iter().find(|(c, _)| c == text) {
            Some((_, id)) => format!("<[{id}]>"),
            None => Value::String(text.to_string()).to_string(),
        }
    }

    /// A constraint for one generation, or why the grammar is refused.
    pub fn constraint(&self, spec: &GrammarSpec) -> Result<Constraint, String> {
        let g = match spec {
            GrammarSpec::JsonSchema { schema, strict } => {
                TopLevelGrammar::from_json_schema(json_layout(schema, *strict))
            }
            GrammarSpec::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
        };
        let m = Matcher::new(self.factory.create_parser(g));
        if let Some(e) = m.get_error() {
            return Err(e.trim().to_string());
        }
        Ok(Constraint {
            m: Arc::new(Mutex::new(m)),
            next: None,
            ready: VecDeque::new(),
            assumed: VecDeque::new(),
            eos: self.eos.clone(),
            busy: std::time::Duration::ZERO,
            applied: 0,
        })
    }
}

/// `schema` with llguidance's layout options set where it does not set them: JSON laid out as
/// Python's `json.dumps` does (`{"a": 1, "b": [2, 3]}`), since free whitespace lets a model pad
/// without end; unsupported keywords refused when `strict`, else ignored.
pub fn json_layout(schema: &Value, strict: bool) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(o) = &mut schema {
        let x = o
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({}));
        if let Some(x) = x.as_object_mut() {
            for (k, v) in [
                ("whitespace_flexible", Value::Bool(false)),
                ("item_separator", Value::from(", ")),
                ("key_separator", Value::from(": ")),
                ("lenient", Value::Bool(!strict)),
            ] {
                x.entry(k).or_insert(v);
            }
        }
    }
    schema
}

/// `schema` with every object schema that leaves `additionalProperties` unset closed
/// (`false`): the answer names the properties the schema names and no others, as OpenAI's
/// strict mode requires and as vLLM (xgrammar) and llama.cpp's converter read such schemas; a
/// schema that sets `additionalProperties` (or `unevaluatedProperties`) keeps it. An object
/// schema is one whose `type` is or includes `"object"`, or that has `properties` without a
/// `type`. The members of an `allOf`, and a schema that has one, are left open (they are merged:
/// closing one part would refuse the keys of another), though the schemas inside them are
/// closed.
pub fn close_objects(schema: &mut Value) {
    close(schema, true);
}

fn close(schema: &mut Value, closable: bool) {
    let Value::Object(o) = schema else {
        return;
    };
    let typed_object = match o.get("type") {
        Some(Value::String(t)) => t == "object",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
        None => o.contains_key("properties"),
        Some(_) => false,
    };
    if closable
        && typed_object
        && !o.contains_key("allOf")
        && !o.contains_key("additionalProperties")
        && !o.contains_key("unevaluatedProperties")
    {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (k, v) in o.iter_mut() {
        match (k.as_str(), v) {
            // maps of names to schemas
            ("properties" | "patternProperties" | "$defs" | "definitions", Value::Object(m)) => {
                m.values_mut().for_each(|s| close(s, true))
            }
            // lists of schemas
            ("anyOf" | "oneOf" | "prefixItems", Value::Array(a)) => {
                a.iter_mut().for_each(|s| close(s, true))
            }
            ("allOf", Value::Array(a)) => a.iter_mut().for_each(|s| close(s, false)),
            // one schema
            (
                "items"
                | "additionalProperties"
                | "additionalItems"
                | "contains"
                | "not"
                | "if"
                | "then"
                | "else"
                | "propertyNames",
                s,
            ) => close(s, true),
            _ => {}
        }
    }
}

/// One generation's grammar state: the mask of the next token, advanced token by token.
pub struct Constraint {
    m: Arc<Mutex<Matcher>>,
    /// Masks being computed beside the forward step ([`Self::prepare`]): the next token's, then
    /// the one after each draft.
    next: Option<par::Beside<Prepared>>,
    /// Prepared masks: the front one is the current state's; each after it assumes the draft
    /// at the same place in `assumed` taken.
    ready: VecDeque<Result<SimpleVob, String>>,
    assumed: VecDeque<u32>,
    eos: Arc<[u32]>,
    /// Time spent in [`Self::apply`] and [`Self::accept`] (on the generating thread, waiting for
    /// a mask computed beside included), and the masks applied, since [`Self::take_busy`].
    busy: std::time::Duration,
    applied: u64,
}

impl Clone for Constraint {
    /// The same grammar state, with no mask under way.
    fn clone(&self) -> Self {
        Self {
            m: Arc::new(Mutex::new(self.matcher().clone())),
            next: None,
            ready: VecDeque::new(),
            assumed: VecDeque::new(),
            eos: self.eos.clone(),
            busy: self.busy,
            applied: self.applied,
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher().is_stopped())
            .finish()
    }
}

impl Constraint {
    fn matcher(&self) -> MutexGuard<'_, Matcher> {
        self.m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The time spent applying masks and taking tokens on the generating thread, and the masks
    /// applied, since the last call (what the grammar added to the steps).
    pub fn take_busy(&mut self) -> (std::time::Duration, u64) {
        let r = (self.busy, self.applied);
        (self.busy, self.applied) = (std::time::Duration::ZERO, 0);
        r
    }

    /// Starts computing the masks [`Self::apply`] takes next on an idle helper of the compute
    /// pool (`par::beside`), so that they are ready when the forward step's logits are: the
    /// current state's, then the state's after each of `drafts` (the step's other rows), on a
    /// copy of the grammar state. Called before the step, once the token it feeds has been
    /// taken. A mask prepared for a draft is used only if that draft is taken
    /// ([`Self::accept`]); taking another token drops the rest.
    pub fn prepare(&mut self, drafts: &[u32]) {
        if self.next.is_some() || !self.ready.is_empty() || self.matcher().is_stopped() {
            return;
        }
        let (m, eos) = (self.m.clone(), self.eos.clone());
        let chain = drafts.to_vec();
        self.next = Some(par::beside(move || {
            let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
            let mut masks = vec![m.compute_mask_or_eos().map_err(|e| grammar_error(&m, e))];
            if chain.is_empty() {
                return Prepared {
                    masks,
                    assumed: chain,
                };
            }
            // the drafts go to a copy, which shares the lexer's caches, not the parser's state
            let mut c = m.clone();
            drop(m);
            for &d in &chain {
                if c.is_stopped() || eos.contains(&d) || c.consume_token(d).is_err() {
                    break;
                }
                masks.push(c.compute_mask_or_eos().map_err(|e| grammar_error(&c, e)));
            }
            let n = masks.len() - 1;
            Prepared {
                masks,
                assumed: chain[..n].to_vec(),
            }
        }));
    }

    /// Sets every token the grammar does not allow next to minus infinity.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let t = std::time::Instant::now();
        let r = self.apply_mask(logits);
        self.busy += t.elapsed();
        self.applied += 1;
        r
    }

    fn apply_mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        if let Some(next) = self.next.take() {
            let p = next.join();
            (self.ready, self.assumed) = (p.masks.into(), p.assumed.into());
        }
        let computed;
        let mask = match self.ready.front() {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(e.clone()),
            None => {
                let mut m = self.matcher();
                computed = m.compute_mask_or_eos().map_err(|e| grammar_error(&m, e))?;
                &computed
            }
        };
        // 32 tokens per word of the mask: a full word leaves them, an empty one clears them
        let words = mask.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX && chunk.len() == 32 {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits >> b & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// Takes `t` as the next token. An end-of-sequence token the grammar allowed ends the
    /// generation and is not fed to it.
    pub fn accept(&mut self, t: u32) -> Result<(), String> {
        let start = std::time::Instant::now();
        let r = self.take_token(t);
        self.busy += start.elapsed();
        r
    }

    fn take_token(&mut self, t: u32) -> Result<(), String> {
        // a computation still under way is for the state before `t` (and nothing is ready
        // while one is); the current state's prepared mask is spent; the next one holds if it
        // assumed `t`
        self.next = None;
        let holds = self.ready.pop_front().is_some() && self.assumed.front() == Some(&t);
        if holds {
            self.assumed.pop_front();
        } else {
            self.ready.clear();
            self.assumed.clear();
        }
        let mut m = self.matcher();
        if m.is_stopped() {
            return Ok(());
        }
        if self.eos.contains(&t) && m.is_accepting().unwrap_or(false) {
            return Ok(());
        }
        m.consume_token(t).map_err(|e| grammar_error(&m, e))
    }

    /// The tokens the grammar forces after the tokens taken so far (none when it leaves a
    /// choice).
    pub fn forced(&mut self) -> Vec<u32> {
        let mut m = self.matcher();
        if m.is_stopped() {
            return Vec::new();
        }
        m.compute_ff_tokens()
    }

    /// The grammar is complete and admits nothing more: the generation is over.
    pub fn finished(&self) -> bool {
        self.matcher().is_stopped()
    }
}

/// The masks a [`Constraint::prepare`] computed, and the drafts they assume taken.
struct Prepared {
    masks: Vec<Result<SimpleVob, String>>,
    assumed: Vec<u32>,
}

/// A grammar failure as the client reads it: the matcher's own error where it has one.
fn grammar_error(m: &Matcher, e: impl std::fmt::Display) -> String {
    format!(
        "grammar: {}",
        m.get_error().unwrap_or_else(|| e.to_string())
    )
}
