//! The one request both APIs translate into: a prompt (token ids, or a [`Conversation`] rendered
//! by the chat template), the shared settings, and how the answer is taken apart. Each adapter
//! reads its body into prompts and settings (`anthropic` one [`Request`]; `openai` one prompt,
//! or a completion's list of them), queues them ([`submit`], [`submit_all`]), and writes the
//! scheduler's events back in its own shapes ([`whole`] collects them for a non-streamed
//! answer).

use axum::http::StatusCode;
use tokio::sync::mpsc;

use super::error::{bad, error, ApiError};
use super::scheduler::{Event, Job, Refused, TokenLogprob};
use super::settings::Settings;
use super::Shared;
use crate::decode::grammar::{Constraint, GrammarSpec, Grammars};
use crate::decode::template::{drop_null_keys, tool_arguments, ChatInput, ChatTemplate};
use crate::decode::tokenizer::TextTokenizer;
use crate::decode::tool_calls::ToolFormat;

/// How a chat answer is taken apart.
#[derive(Debug, Clone, Copy)]
pub(super) struct ChatMode {
    /// The turn opened `<think>`: reasoning comes first.
    pub(super) thinking: bool,
    /// Tool calls are read back in this format.
    pub(super) tools: Option<ToolFormat>,
}

/// A generation as the server runs it, whichever API asked.
#[derive(Debug)]
pub(super) struct Request {
    pub(super) prompt: Vec<u32>,
    pub(super) settings: Settings,
    /// A chat answer (reasoning and tool calls taken apart), or plain text.
    pub(super) chat: Option<ChatMode>,
    /// The grammar the answer follows (structured output), if any.
    pub(super) constraint: Option<Constraint>,
}

/// A constraint for `spec` from the server's grammar machinery (built on first use); a grammar
/// llguidance refuses is a 400 with its reason.
pub(super) fn constraint(s: &Shared, spec: &GrammarSpec) -> Result<Constraint, ApiError> {
    grammars(s)?
        .constraint(spec)
        .map_err(|e| bad(format!("the grammar is refused: {e}")))
}

/// The server's grammar machinery, built on first use.
pub(super) fn grammars(s: &Shared) -> Result<&Grammars, ApiError> {
    let g = s.grammars.get_or_init(|| {
        let t = std::time::Instant::now();
        let g = Grammars::new(&s.tok, s.vocab, &s.stop_ids).map(std::sync::Arc::new);
        tracing::info!(
            ms = t.elapsed().as_secs_f64() * 1e3,
            ok = g.is_ok(),
            "grammar machinery built"
        );
        g
    });
    g.as_deref().map_err(|e| {
        error(
            StatusCode::NOT_IMPLEMENTED,
            "invalid_request_error",
            format!("structured output is not available for this model: {e}"),
        )
    })
}

/// A conversation in the form the chat templates read (OpenAI's messages and tools).
#[derive(Debug, Default)]
pub(super) struct Conversation {
    pub(super) messages: minijinja::Value,
    /// The tools the model may call (none: `()`).
    pub(super) tools: minijinja::Value,
    /// Extra template variables (`chat_template_kwargs`).
    pub(super) kwargs: Vec<(String, minijinja::Value)>,
}

impl Conversation {
    /// The conversation of an OpenAI body `v` (read in its key order, which the template
    /// sees) for template `t`: its `messages` without null keys and with tool-call arguments in
    /// the form `t` reads (clients send JSON text), its `tools` when `use_tools` (a list), its
    /// `chat_template_kwargs` (an object; absent or null: none).
    pub(super) fn openai(
        v: &minijinja::Value,
        t: &ChatTemplate,
        use_tools: bool,
    ) -> Result<Self, ApiError> {
        let mut messages = drop_null_keys(&v.get_attr("messages").unwrap_or_default());
        match t.tool_format {
            Some(ToolFormat::Glm) => messages = tool_arguments(&messages, true),
            Some(ToolFormat::DeepSeek) => messages = tool_arguments(&messages, false),
            _ => {}
        }
        let tools = if use_tools {
            let t = v.get_attr("tools").unwrap_or_default();
            if t.kind() != minijinja::value::ValueKind::Seq {
                return Err(bad("`tools` must be a list"));
            }
            t
        } else {
            minijinja::Value::from(())
        };
        let kwargs = match v.get_attr("chat_template_kwargs") {
            Ok(k) if !k.is_undefined() && !k.is_none() => k
                .try_iter()
                .map_err(|_| bad("`chat_template_kwargs` must be an object"))?
                .filter_map(|key| {
                    let val = k.get_item(&key).ok()?;
                    Some((key.as_str()?.to_string(), val))
                })
                .collect(),
            _ => vec![],
        };
        Ok(Self {
            messages,
            tools,
            kwargs,
        })
    }

    /// The text of the conversation as template `t` renders it; with `add_generation_prompt`,
    /// the assistant's turn opened.
    pub(super) fn text(
        self,
        t: &ChatTemplate,
        add_generation_prompt: bool,
    ) -> Result<String, ApiError> {
        t.render(&ChatInput {
            messages: self.messages,
            tools: self.tools,
            add_generation_prompt,
            bos_token: None,
            eos_token: None,
            kwargs: self.kwargs,
        })
        .map_err(|e| bad(e.to_string()))
    }

    /// The prompt of the conversation, with the assistant's turn opened; and whether that turn
    /// opens with `<think>` (the model reasons first).
    pub(super) fn prompt(
        self,
        t: &ChatTemplate,
        tok: &TextTokenizer,
    ) -> Result<(Vec<u32>, bool), ApiError> {
        let text = self.text(t, true)?;
        let prompt = tok.encode(&text).map_err(|e| bad(e.to_string()))?;
        // a template that opens the assistant's turn with `<think>` (GLM with thinking on) has
        // the model reason first
        Ok((prompt, text.trim_end().ends_with("<think>")))
    }
}

/// Refuses a body naming a model this server does not serve (404, naming the one it serves).
/// The served name and the model directory's name are both accepted; no `model` is the served
/// one.
pub(super) fn check_model(s: &Shared, body: &serde_json::Value) -> Result<(), ApiError> {
    match &body["model"] {
        serde_json::Value::Null => Ok(()),
        serde_json::Value::String(m) if s.opts.serves(m) => Ok(()),
        serde_json::Value::String(m) => Err(error(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!(
                "the model `{m}` does not exist here: this server serves `{}`",
                s.opts.model_name
            ),
        )),
        _ => Err(bad("`model` must be a string")),
    }
}

/// Checks a prompt against the context and queues its generation with `set.n` choices; the
/// events of choice `i` come on receiver `i`. With `prompt_logprobs`, the prompt's own log
/// probabilities come first ([`Event::Prompt`]).
pub(super) fn submit(
    s: &Shared,
    prompt: Vec<u32>,
    set: &Settings,
    prompt_logprobs: Option<usize>,
    constraint: Option<Constraint>,
) -> Result<Vec<mpsc::UnboundedReceiver<Event>>, ApiError> {
    Ok(submit_all(s, vec![prompt], set, prompt_logprobs, constraint)?.remove(0))
}

/// Prompts of one request at most (a list of prompts on `/v1/completions`).
pub(super) const MAX_PROMPTS: usize = 1024;

/// [`submit`] for the prompts of one request, each its own sequence of the batch (queued
/// together: all or none): the receivers of prompt `p`'s choices come at `p`.
pub(super) fn submit_all(
    s: &Shared,
    prompts: Vec<Vec<u32>>,
    set: &Settings,
    prompt_logprobs: Option<usize>,
    constraint: Option<Constraint>,
) -> Result<Vec<Vec<mpsc::UnboundedReceiver<Event>>>, ApiError> {
    let ctx = s.opts.context;
    if set.n > s.opts.max_active {
        return Err(bad(format!(
            "`n` {} is more than the {} generations this server runs at once (--parallel)",
            set.n, s.opts.max_active
        )));
    }
    if prompts.len() > MAX_PROMPTS {
        return Err(bad(format!(
            "{} prompts: at most {MAX_PROMPTS} in one request",
            prompts.len()
        )));
    }
    let several = prompts.len() > 1;
    let mut jobs = Vec::with_capacity(prompts.len());
    for (p, prompt) in prompts.into_iter().enumerate() {
        // (a list's prompt is named by its place)
        let which = if several {
            format!("prompt {p}: ")
        } else {
            String::new()
        };
        if prompt.is_empty() {
            return Err(bad(format!("{which}the prompt is empty")));
        }
        if prompt.len() >= ctx {
            return Err(bad(format!(
                "{which}the prompt is {} tokens; the context holds {ctx}",
                prompt.len()
            )));
        }
        let max_tokens = set.max_tokens.unwrap_or(ctx - prompt.len());
        if prompt.len() + max_tokens > ctx {
            return Err(bad(format!(
                "{which}the prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the context of {ctx} tokens",
                prompt.len()
            )));
        }
        jobs.push(Job {
            prompt,
            max_tokens,
            params: set.params,
            penalties: set.penalties,
            logprobs: set.logprobs,
            stop: set.stop.clone(),
            ignore_eos: set.ignore_eos,
            prompt_logprobs,
            n: set.n,
            constraint: constraint.clone(),
        });
    }
    s.scheduler.submit_all(jobs).map_err(|e| match e {
        Refused::Full => error(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "too many requests waiting; retry shortly",
        ),
        Refused::Stopped => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the generator stopped",
        ),
    })
}

/// The events of every choice on one receiver, each with its choice's index. A forwarder ends
/// when its choice ends or the merged receiver is dropped (which drops the choice's receiver:
/// the scheduler cancels it).
pub(super) fn merged(
    rxs: Vec<mpsc::UnboundedReceiver<Event>>,
) -> mpsc::UnboundedReceiver<(usize, Event)> {
    let (tx, out) = mpsc::unbounded_channel();
    for (i, mut rx) in rxs.into_iter().enumerate() {
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    ev = rx.recv() => match ev {
                        Some(ev) => if tx.send((i, ev)).is_err() { return },
                        None => return,
                    },
                    _ = tx.closed() => return,
                }
            }
        });
    }
    out
}

/// A whole answer.
#[derive(Debug)]
pub(super) struct Answer {
    pub(super) text: String,
    pub(super) finish: &'static str,
    /// The stop string that ended it, if one did.
    pub(super) matched: Option<String>,
    pub(super) logprobs: Vec<TokenLogprob>,
    /// The prompt's log probabilities, when asked (one per prompt token after the first).
    pub(super) prompt_logprobs: Vec<TokenLogprob>,
    pub(super) prompt_tokens: usize,
    pub(super) completion_tokens: usize,
    /// Speculative decoding: tokens drafted, and of them accepted.
    pub(super) drafted: usize,
    pub(super) accepted: usize,
}

/// Waits for the whole answer of a generation.
pub(super) async fn whole(mut rx: mpsc::UnboundedReceiver<Event>) -> Result<Answer, ApiError> {
    let mut text = String::new();
    let mut prompt_logprobs = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text += &t,
            Event::Logprobs(_) => {}
            Event::Prompt(p) => prompt_logprobs = p,
            Event::Failed(m) => {
                return Err(error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m))
            }
            Event::Done {
                finish,
                matched,
                logprobs,
                prompt_tokens,
                completion_tokens,
                drafted,
                accepted,
            } => {
                return Ok(Answer {
                    text,
                    finish,
                    matched,
                    logprobs,
                    prompt_logprobs,
                    prompt_tokens,
                    completion_tokens,
                    drafted,
                    accepted,
                })
            }
        }
    }
    Err(error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "the generation ended without a result",
    ))
}

/// OpenAI's usage object; with speculative decoding, the drafted tokens the model accepted and
/// rejected (OpenAI's `completion_tokens_details` names for predicted tokens).
pub(super) fn usage(
    prompt: usize,
    completion: usize,
    drafted: usize,
    accepted: usize,
) -> serde_json::Value {
    let mut u = serde_json::json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion});
    if drafted > 0 {
        u["completion_tokens_details"] = serde_json::json!({
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        });
    }
    u
}
