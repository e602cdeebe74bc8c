//! `charm chat`: a terminal conversation with a local model or a running `charm serve`.
//!
//! Each line typed is a user turn; the answer streams as it is generated, then a line of speed
//! (tokens per second, time to first token, and the expert hit rate for a local streamed model).
//! `/reset` forgets the conversation, `/quit` (or end of input) leaves.

use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use charm_coordinator::decode::generate::generate_streaming;
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::decode::speculative::DraftOptions;
use charm_coordinator::decode::template::{ChatInput, ChatTemplate};
use charm_coordinator::decode::tokenizer::TextTokenizer;
use charm_coordinator::ForwardOptions;
use charm_shared::quant::Activations;
use clap::Args;

use crate::common::{self, Act, DraftArgs, StoreArgs};

/// The flags of `charm chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    #[arg(long, required_unless_present = "url", conflicts_with = "url")]
    pub model: Option<PathBuf>,
    /// An OpenAI-compatible server, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub url: Option<String>,
    /// File holding the server's API key.
    #[arg(long, requires = "url")]
    pub api_key_file: Option<PathBuf>,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, value_enum, default_value = "f32")]
    pub activations: Act,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
}

/// `charm chat`: checks the sampling flags, then converses with the local model or the server.
pub fn chat(a: ChatArgs) -> Result<()> {
    let ChatArgs {
        model,
        url,
        api_key_file,
        max_tokens,
        temperature,
        top_p,
        seed,
        activations,
        store,
        draft,
    } = a;
    if !(temperature >= 0.0 && temperature.is_finite()) {
        bail!("--temperature must be >= 0");
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        bail!("--top-p must be in (0, 1]");
    }
    if max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let set = ChatSettings {
        params: SamplingParams {
            temperature,
            top_p,
            seed,
            ..Default::default()
        },
        max_tokens,
        draft: draft.options(store.cluster.is_some()),
    };
    match (model, url) {
        (Some(m), _) => chat_local(&m, &store, activations.into(), set),
        (None, Some(u)) => {
            let key = match api_key_file {
                Some(f) => Some(
                    std::fs::read_to_string(&f)
                        .with_context(|| format!("--api-key-file {}", f.display()))?
                        .trim()
                        .to_string(),
                ),
                None => None,
            };
            chat_remote(&u, key.as_deref(), set)
        }
        (None, None) => bail!("give --model or --url"),
    }
}

/// How answers are sampled.
#[derive(Debug, Clone, Copy)]
struct ChatSettings {
    params: SamplingParams,
    max_tokens: usize,
    /// Speculative decoding of a local model's answers.
    draft: DraftOptions,
}

/// One turn's figures.
struct Turn {
    text: String,
    tokens: usize,
    ttft: f64,
    seconds: f64,
}

fn speed_line(t: &Turn, extra: &str) -> String {
    let rate = if t.seconds > t.ttft && t.tokens > 1 {
        (t.tokens - 1) as f64 / (t.seconds - t.ttft)
    } else {
        0.0
    };
    format!(
        "[{} tokens, {rate:.1} tok/s, first token after {:.0} ms{extra}]",
        t.tokens,
        t.ttft * 1e3
    )
}

/// Runs the conversation loop over `input`, writing answers to `out`; `answer` produces a turn
/// from the conversation so far (a list of `(role, content)`), printing its text as it comes.
fn converse(
    input: impl BufRead,
    out: &mut dyn Write,
    mut answer: impl FnMut(&[(String, String)], &mut dyn Write) -> Result<(Turn, String)>,
) -> Result<()> {
    let mut history: Vec<(String, String)> = Vec::new();
    write!(out, "> ")?;
    out.flush()?;
    for line in input.lines() {
        let line = line?;
        let line = line.trim();
        match line {
            "" => {}
            "/quit" | "/exit" => break,
            "/reset" => {
                history.clear();
                writeln!(out, "(conversation cleared)")?;
            }
            _ => {
                history.push(("user".into(), line.to_string()));
                let (turn, extra) = answer(&history, out)?;
                writeln!(out)?;
                writeln!(out, "{}", speed_line(&turn, &extra))?;
                history.push(("assistant".into(), turn.text));
            }
        }
        write!(out, "> ")?;
        out.flush()?;
    }
    writeln!(out)?;
    Ok(())
}

/// `charm chat --model DIR`: the conversation on a model loaded here.
fn chat_local(model: &Path, store: &StoreArgs, act: Activations, set: ChatSettings) -> Result<()> {
    let spec = charm_shared::config::ModelSpec::from_dir(model)?;
    let context = store
        .ctx
        .unwrap_or_else(|| spec.max_position_embeddings.clamp(1, 4096));
    let e = common::load(model, store, context, act)?;
    let tok = TextTokenizer::load(model)?;
    let Some(template) = ChatTemplate::from_dir(model)? else {
        bail!("{} has no chat template", model.display());
    };
    let m = &e.model;
    let stdin = std::io::stdin();
    converse(stdin.lock(), &mut std::io::stdout(), |history, out| {
        let messages: Vec<minijinja::Value> = history
            .iter()
            .map(|(r, c)| {
                minijinja::Value::from_pairs([
                    ("role", minijinja::Value::from(r.as_str())),
                    ("content", minijinja::Value::from(c.as_str())),
                ])
            })
            .collect();
        let prompt_text = template.render(&ChatInput {
            messages: minijinja::Value::from(messages),
            tools: minijinja::Value::from(()),
            add_generation_prompt: true,
            ..Default::default()
        })?;
        let prompt = tok.encode(&prompt_text)?;
        if prompt.len() + set.max_tokens > context {
            bail!(
                "the conversation ({} tokens) plus --max-tokens {} exceeds the context of {context} tokens: /reset",
                prompt.len(),
                set.max_tokens
            );
        }
        let before = e.stats();
        let t0 = Instant::now();
        let draft = set.draft;
        let mut sampler = Sampler::new(set.params);
        let (mut shown, mut ttft, mut failed) = (0usize, None, None);
        let mut stream = tok.stream();
        let eos = &m.spec.eos_token_ids;
        let g = generate_streaming(
            m,
            &prompt,
            set.max_tokens,
            &mut sampler,
            eos,
            ForwardOptions::default(),
            draft,
            &mut |t| {
                ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                if eos.contains(&t) || failed.is_some() {
                    return;
                }
                // whole characters only, decoding just the last tokens
                let shown_now = stream
                    .push(t)
                    .map_err(anyhow::Error::from)
                    .and_then(|piece| {
                        if !piece.is_empty() {
                            write!(out, "{piece}")?;
                            out.flush()?;
                        }
                        Ok(piece.len())
                    });
                match shown_now {
                    Ok(n) => shown += n,
                    Err(e) => failed = Some(e),
                }
            },
        )?;
        if let Some(e) = failed {
            return Err(e);
        }
        let ttft = ttft.unwrap_or_default();
        let mut ids = g.ids;
        if g.finish_reason == "stop" {
            ids.pop(); // the end-of-sequence token is not part of the answer
        }
        m.experts.step_end();
        let text = tok.decode(&ids)?;
        if text.len() > shown {
            write!(out, "{}", &text[shown..])?;
        }
        let extra = match (e.stats(), before) {
            (Some(now), Some(b)) if now.hits + now.misses > b.hits + b.misses => {
                format!(", expert hit rate {:.1}%", 100.0 * now.since(&b).hit_rate())
            }
            _ => String::new(),
        };
        Ok((
            Turn {
                text,
                tokens: ids.len(),
                ttft,
                seconds: t0.elapsed().as_secs_f64(),
            },
            extra,
        ))
    })
}

/// `charm chat --url http://HOST:PORT`: the conversation on a running `charm serve` (or any
/// OpenAI-compatible server), streamed over its chat completions route.
fn chat_remote(url: &str, api_key: Option<&str>, set: ChatSettings) -> Result<()> {
    let rest = url
        .strip_prefix("http://")
        .context("--url: give http://HOST:PORT (https is not supported here)")?;
    let (host, base) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    let path = format!("{base}/v1/chat/completions");
    let stdin = std::io::stdin();
    converse(stdin.lock(), &mut std::io::stdout(), |history, out| {
        let messages: Vec<serde_json::Value> = history
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        let body = serde_json::json!({
            "messages": messages,
            "max_tokens": set.max_tokens,
            "temperature": set.params.temperature,
            "top_p": set.params.top_p,
            "seed": set.params.seed,
            "stream": true,
        })
        .to_string();
        let t0 = Instant::now();
        let mut s = std::net::TcpStream::connect(host).with_context(|| format!("--url {url}"))?;
        let auth = api_key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut r = std::io::BufReader::new(s);
        let mut status = String::new();
        r.read_line(&mut status)?;
        // headers
        let mut chunked = false;
        loop {
            let mut l = String::new();
            r.read_line(&mut l)?;
            if l.trim().is_empty() {
                break;
            }
            chunked |=
                l.to_ascii_lowercase().starts_with("transfer-encoding") && l.contains("chunked");
        }
        if !status.contains(" 200 ") {
            let mut rest = String::new();
            let _ = r.read_to_string(&mut rest);
            bail!("{}: {}", status.trim(), rest.trim());
        }
        let mut body = Vec::new();
        let (mut text, mut ttft, mut tokens) = (String::new(), None, 0usize);
        let mut pending = String::new();
        let mut handle = |chunk: &str, out: &mut dyn Write| -> Result<()> {
            pending.push_str(chunk);
            while let Some(i) = pending.find("\n\n") {
                let ev: String = pending.drain(..i + 2).collect();
                let Some(data) = ev.trim().strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(data)?;
                if let Some(d) = v["choices"][0]["delta"]["content"].as_str() {
                    ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                    write!(out, "{d}")?;
                    out.flush()?;
                    text += d;
                }
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    tokens = n as usize;
                }
            }
            Ok(())
        };
        if chunked {
            loop {
                let mut size = String::new();
                if r.read_line(&mut size)? == 0 {
                    break;
                }
                let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
                if n == 0 {
                    break;
                }
                body.resize(n + 2, 0);
                r.read_exact(&mut body)?;
                handle(&String::from_utf8_lossy(&body[..n]), out)?;
            }
        } else {
            let mut all = String::new();
            r.read_to_string(&mut all)?;
            handle(&all, out)?;
        }
        Ok((
            Turn {
                text,
                tokens,
                ttft: ttft.unwrap_or(0.0),
                seconds: t0.elapsed().as_secs_f64(),
            },
            String::new(),
        ))
    })
}
