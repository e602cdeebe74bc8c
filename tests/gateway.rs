//! `charm serve` as a process on loopback, driven over real HTTP/1.1 connections.

mod common;

use common::http::{http, post, Reply};
use common::server::{demo, Server};

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use charm_coordinator::decode::generate::generate;
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::decode::tokenizer::TextTokenizer;
use charm_coordinator::{Engine, EngineOptions, ForwardOptions};
use serde_json::{json, Value};

/// A copy of the demo model (its files linked) whose chat template is `edit` of the demo's.
fn demo_with_template(tag: &str, edit: impl FnOnce(&str) -> String) -> PathBuf {
    let d = common::scratch(tag);
    std::fs::create_dir_all(&d).unwrap();
    for f in std::fs::read_dir(demo()).unwrap() {
        let f = f.unwrap().path();
        let name = f.file_name().unwrap().to_owned();
        if name != "chat_template.jinja" {
            std::os::unix::fs::symlink(&f, d.join(name)).unwrap();
        }
    }
    let t = std::fs::read_to_string(demo().join("chat_template.jinja")).unwrap();
    std::fs::write(d.join("chat_template.jinja"), edit(&t)).unwrap();
    d
}

/// The content of a streamed chat completion's deltas, joined.
fn streamed_content(body: &[u8]) -> String {
    events(body)
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect()
}

/// The `data:` payloads of a server-sent event stream.
fn events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: ").map(String::from))
        .collect()
}

/// What the library generates greedily for `prompt`.
fn greedy_text(prompt: &str, n: usize) -> String {
    let e = Engine::load(&demo(), &EngineOptions::default()).unwrap();
    let tok = TextTokenizer::load(&demo()).unwrap();
    let g = generate(
        &e.model,
        &tok.encode(prompt).unwrap(),
        n,
        &mut Sampler::new(SamplingParams::default()),
        &e.model.spec.eos_token_ids,
        ForwardOptions::default(),
    )
    .unwrap();
    tok.decode(&g.ids).unwrap()
}

#[test]
fn completions_and_chat_answer_as_the_engine_generates_streamed_or_not() {
    let s = Server::start(&[]);
    let h = http(&s.addr, "GET", "/health", &[], b"");
    assert_eq!((h.status, h.json()["status"].clone()), (200, json!("ok")));
    let m = http(&s.addr, "GET", "/v1/models", &[], b"").json();
    assert_eq!(m["data"][0]["id"], "charm-bard-moe");

    let want = greedy_text("ROMEO. ", 24);
    let r = post(
        &s.addr,
        "/v1/completions",
        &json!({"model": "charm-bard-moe", "prompt": "ROMEO. ", "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert_eq!(v["usage"]["completion_tokens"], 24);
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // streamed: the pieces add up to the same text, then the finish, the usage and [DONE]
    let r = post(
        &s.addr,
        "/v1/completions",
        &json!({"prompt": "ROMEO. ", "max_tokens": 24, "temperature": 0, "stream": true}),
    );
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let ev = events(&r.body);
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, want);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 24);

    // a stop string: the text ends before it, in both modes
    let cut = want.find("KING").expect("the sample names a king");
    let stop = json!({"prompt": "ROMEO. ", "max_tokens": 24, "temperature": 0, "stop": ["KING"]});
    let v = post(&s.addr, "/v1/completions", &stop).json();
    assert_eq!(v["choices"][0]["text"], &want[..cut]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut st = stop.clone();
    st["stream"] = json!(true);
    let streamed: String = events(&post(&s.addr, "/v1/completions", &st).body)
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(streamed, &want[..cut]);

    // chat: the model's template, streamed deltas equal to the whole answer
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak, Romeo."}], "max_tokens": 16, "temperature": 0});
    let v = post(&s.addr, "/v1/chat/completions", &chat).json();
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 4);
    let mut c = chat.clone();
    c["stream"] = json!(true);
    let deltas = streamed_content(&post(&s.addr, "/v1/chat/completions", &c).body);
    assert_eq!(deltas, answer);
}

#[test]
fn bad_requests_get_clear_errors_and_the_server_keeps_serving() {
    let s = Server::start(&[]);
    let err = |r: &Reply, status: u16, needle: &str| {
        assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
        let m = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(m.contains(needle), "{m} (wanted {needle})");
    };
    let c = "/v1/completions";
    let raw = |b: &[u8]| {
        http(
            &s.addr,
            "POST",
            c,
            &[("Content-Type", "application/json")],
            b,
        )
    };
    err(&raw(b"{\"prompt\": "), 400, "not valid JSON");
    err(&raw(b"\xff\xfe{}"), 400, "not valid JSON");
    err(&raw(b"[1, 2]"), 400, "JSON object");
    err(
        &post(&s.addr, c, &json!({"prompt": "x", "temperature": "hot"})),
        400,
        "`temperature` must be a number",
    );
    err(&post(&s.addr, c, &json!({"prompt": 7})), 400, "`prompt`");
    err(
        &post(&s.addr, c, &json!({"prompt": "x", "colour": 1})),
        400,
        "unknown field `colour`",
    );
    err(
        &post(&s.addr, c, &json!({"prompt": "x", "logprobs": 30})),
        400,
        "at most 20",
    );
    err(
        &post(&s.addr, c, &json!({"prompt": "x", "n": 40})),
        400,
        "`n`",
    );
    err(
        &post(&s.addr, c, &json!({"prompt": "x", "max_tokens": 5000})),
        400,
        "exceeds the context of 1024 tokens",
    );
    let long = "word ".repeat(3000);
    err(
        &post(&s.addr, c, &json!({"prompt": long})),
        400,
        "the context holds 1024",
    );
    let chat = "/v1/chat/completions";
    err(
        &post(&s.addr, chat, &json!({"messages": []})),
        400,
        "`messages`",
    );
    err(
        &post(
            &s.addr,
            chat,
            &json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
        ),
        400,
        "does not define tool calls",
    );
    err(
        &post(
            &s.addr,
            chat,
            &json!({"messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": "sometimes"}),
        ),
        400,
        "tool_choice",
    );
    // tool_choice none: the tools are left out and the answer is plain
    let r = post(
        &s.addr,
        chat,
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}),
    );
    assert_eq!(r.status, 200);
    err(
        &post(&s.addr, c, &json!({"prompt": "x", "tools": []})),
        400,
        "tool calls are not supported yet",
    );
    // a body over the limit
    let huge = format!("{{\"prompt\": \"{}\"}}", "a".repeat(5 << 20));
    assert_eq!(raw(huge.as_bytes()).status, 413);
    assert_eq!(http(&s.addr, "GET", "/nowhere", &[], b"").status, 404);
    // still serving
    let v = post(&s.addr, c, &json!({"prompt": "ROMEO. ", "max_tokens": 3})).json();
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[test]
fn a_key_is_required_when_configured_and_beyond_loopback() {
    let dir = common::scratch("gw-key");
    std::fs::create_dir_all(&dir).unwrap();
    let key = dir.join("key");
    std::fs::write(&key, "s3cret-key-of-some-length\n").unwrap();
    let s = Server::start(&["--api-key-file", key.to_str().unwrap()]);
    let models = |auth: Option<&str>| {
        let h: Vec<(&str, &str)> = auth.map(|a| ("Authorization", a)).into_iter().collect();
        http(&s.addr, "GET", "/v1/models", &h, b"").status
    };
    assert_eq!(models(None), 401);
    assert_eq!(models(Some("Bearer wrong-key-of-some-length")), 401);
    assert_eq!(models(Some("Bearer s3cret-key-of-some-length")), 200);
    assert_eq!(http(&s.addr, "GET", "/health", &[], b"").status, 200);
    let r = post(&s.addr, "/v1/completions", &json!({"prompt": "x"}));
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    drop(s);
    // all interfaces without a key: refused
    let o = Command::new(env!("CARGO_BIN_EXE_charm"))
        .args(["serve", "--model"])
        .arg(demo())
        .args(["--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("api-key-file"));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn metric(addr: &str, name: &str) -> f64 {
    let r = http(addr, "GET", "/metrics", &[], b"");
    String::from_utf8_lossy(&r.body)
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{name} "))
                .map(|v| v.parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no {name}"))
}

/// Polls `ok` until it holds, failing with `what` after a minute (a loaded machine may be slow;
/// nothing here depends on how slow).
fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !ok() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(60),
            "gave up waiting: {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Sends a streamed completion of `max_tokens` tokens of `prompt` (past any end-of-sequence
/// token) on a fresh connection, without reading the answer; dropping the connection leaves.
fn send_stream(addr: &str, prompt: &str, max_tokens: usize) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    let body =
        json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true, "ignore_eos": true})
            .to_string();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    c
}

/// [`send_stream`], then reads until the generation's first token arrives: it is running.
fn running_stream(addr: &str, prompt: &str, max_tokens: usize) -> (TcpStream, Vec<u8>) {
    let mut c = send_stream(addr, prompt, max_tokens);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(6).any(|w| w == b"data: ") {
        let n = c.read(&mut buf).expect("no first token within a minute");
        assert!(
            n > 0,
            "the stream ended before its first token: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    (c, got)
}

/// Appends what `c` has received so far to `into`, without waiting.
fn drain(c: &mut TcpStream, into: &mut Vec<u8>) {
    c.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 1 << 16];
    while let Ok(n) = c.read(&mut buf) {
        if n == 0 {
            break;
        }
        into.extend_from_slice(&buf[..n]);
    }
    c.set_nonblocking(false).unwrap();
}

/// A request of two tokens, sent again while the server answers 429 (as a client would) for up
/// to a minute: it is served once everything queued before it has left the queue.
fn served_when_free(addr: &str) -> Value {
    let t = std::time::Instant::now();
    loop {
        let r = post(
            addr,
            "/v1/completions",
            &json!({"prompt": "ROMEO. ", "max_tokens": 2}),
        );
        if r.status == 200 {
            return r.json();
        }
        assert_eq!(r.status, 429);
        assert!(
            t.elapsed() < std::time::Duration::from_secs(60),
            "never served"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn dozens_of_concurrent_requests_wait_their_turn_by_default() {
    // as lm-evaluation-harness sends them (num_concurrent 64 is common), retrying without
    // reading Retry-After: with the default queue none is refused (with `--queue 16` most were)
    let s = Server::start(&[]);
    let codes: Vec<u16> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..48)
            .map(|i| {
                let a = s.addr.clone();
                sc.spawn(move || {
                    let body = json!({"prompt": format!("ROMEO {i}. "), "max_tokens": 2, "temperature": 0});
                    post(&a, "/v1/completions", &body).status
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(codes.iter().all(|&c| c == 200), "{codes:?}");
}

#[test]
fn a_flood_gets_429_and_a_client_that_leaves_stops_its_generation() {
    let s = Server::start(&["--queue", "1", "--parallel", "1"]);
    // one running, one waiting: the next is refused. Each state is waited for, not assumed:
    // the running generation has produced a token, and the waiting one is seen in the queue.
    let refused = 'flood: loop {
        // a generation of 1000 tokens (past EOS) outlives the steps below by far; should it end
        // first all the same, the round is run again
        let (mut running, mut seen) = running_stream(&s.addr, "ROMEO. ", 1000);
        let waiting = send_stream(&s.addr, "JULIET.\n", 1000);
        let t = std::time::Instant::now();
        while metric(&s.addr, "charm_queue_depth") < 1.0 {
            drain(&mut running, &mut seen);
            if seen.windows(6).any(|w| w == b"[DONE]") {
                // it ended before the second was queued: the server is free again soon
                drop((running, waiting));
                served_when_free(&s.addr);
                continue 'flood;
            }
            assert!(
                t.elapsed() < std::time::Duration::from_secs(60),
                "the second request never queued"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let r = post(
            &s.addr,
            "/v1/completions",
            &json!({"prompt": "ROMEO. ", "max_tokens": 1}),
        );
        if r.status == 429 {
            break r;
        }
        // served: the running generation ended in between (then the queue had room)
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        drop((running, waiting));
        served_when_free(&s.addr);
    };
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.json()["error"]["type"], "rate_limit_error");
    assert!(metric(&s.addr, "charm_requests_rejected_total") >= 1.0);
    // both clients above left: once a request is served again, nothing of theirs runs
    served_when_free(&s.addr);

    // a stream of up to 900 tokens (past EOS) whose client leaves after its first event
    let before = metric(&s.addr, "charm_generated_tokens_total");
    drop(running_stream(&s.addr, "ROMEO. ", 900));
    // the next request runs after the abandoned one ended (429 while that one still holds the
    // queue's place: retried as a client would), so that one must have ended early
    let v = served_when_free(&s.addr);
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let spent = metric(&s.addr, "charm_generated_tokens_total") - before;
    assert!(
        spent < 900.0,
        "the abandoned generation ran on: {spent} tokens"
    );
}

#[test]
fn anthropic_messages_answer_whole_and_streamed() {
    let s = Server::start(&[]);
    let body = json!({"model": "charm-bard-moe", "max_tokens": 16, "temperature": 0, "system": "Be brief.", "messages": [{"role": "user", "content": [{"type": "text", "text": "Speak, Romeo."}]}]});
    let v = post(&s.addr, "/v1/messages", &body).json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["usage"]["output_tokens"], 16);
    let text = v["content"][0]["text"].as_str().unwrap().to_string();
    // the same conversation through the OpenAI route gives the same answer
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak, Romeo."}], "max_tokens": 16, "temperature": 0});
    let o = post(&s.addr, "/v1/chat/completions", &chat).json();
    assert_eq!(o["choices"][0]["message"]["content"], text.as_str());
    let mut st = body.clone();
    st["stream"] = json!(true);
    let raw = String::from_utf8(post(&s.addr, "/v1/messages", &st).body).unwrap();
    let names: Vec<&str> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names.last(), Some(&"message_stop"));
    let streamed: String = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| {
            let v: Value = serde_json::from_str(d).ok()?;
            v["delta"]["text"].as_str().map(String::from)
        })
        .collect();
    assert_eq!(streamed, text);
    // a stop sequence is named
    let cut = text.chars().skip(3).take(3).collect::<String>();
    let mut sq = body.clone();
    sq["stop_sequences"] = json!([cut]);
    let v = post(&s.addr, "/v1/messages", &sq).json();
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], cut.as_str());
    // tools for a template that does not define tool calls: a clear 400
    let mut t = body.clone();
    t["tools"] = json!([{"name": "f", "input_schema": {"type": "object"}}]);
    let r = post(&s.addr, "/v1/messages", &t);
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("tool calls"));
    // errors in Anthropic's shape
    let r = post(
        &s.addr,
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "error");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_tokens"));
}

/// The official `openai` and `anthropic` Python clients (`tests/clients/official.py`) against a
/// server with a key. Needs a Python with both installed, named by `CHARM_TEST_PYTHON`: `.ci/run`
/// makes one in a virtual environment and runs this test.
#[test]
#[ignore = "needs CHARM_TEST_PYTHON with the openai, anthropic, pydantic and jsonschema packages (.ci/run sets it up)"]
fn the_official_python_clients_drive_the_server() {
    let python = std::env::var("CHARM_TEST_PYTHON")
        .expect("CHARM_TEST_PYTHON: a python with `pip install openai anthropic`");
    let dir = common::scratch("gw-clients");
    std::fs::create_dir_all(&dir).unwrap();
    let key = "client-test-key-0123456789";
    std::fs::write(dir.join("key"), key).unwrap();
    let s = Server::start(&["--api-key-file", dir.join("key").to_str().unwrap()]);
    // the demo model with GLM-5.2's template, for tool calls
    let glm = demo_with_real_template_as("GLM-5.2", "GLM-5.2-clients");
    let t = Server::start_model(&glm, &["--api-key-file", dir.join("key").to_str().unwrap()]);
    let o = Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/official.py"))
        .arg(format!("http://{}", s.addr))
        .arg(key)
        .arg(format!("http://{}", t.addr))
        .output()
        .unwrap();
    drop(t);
    std::fs::remove_dir_all(&glm).unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success() && out.trim() == "ok", "{out}\n{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// lm-evaluation-harness (`CHARM_TEST_PYTHON` with `lm-eval[api]` 0.4.13, no torch) against a
/// server of the demo model: a multiple-choice task and a generate_until task on local data
/// (`tests/clients/lm_eval/`) through `local-completions` with token-id batches (`batch_size`
/// 8, `num_concurrent` 4) and its default tokenizer backend (the server's vLLM-style
/// `/tokenize`), and the generate_until task through `local-chat-completions`. Its
/// loglikelihoods equal log-softmax sums of charm's own logits (the library's forward pass, the
/// pair tokenized as lm-eval splits it), its greedy texts `charm generate`'s cut at the task's
/// stop string, and its chat texts the chat API's greedy answers.
#[test]
#[ignore = "needs CHARM_TEST_PYTHON with lm-eval[api] 0.4.13 (.ci/run sets it up)"]
fn lm_evaluation_harness_scores_charm() {
    let python =
        std::env::var("CHARM_TEST_PYTHON").expect("CHARM_TEST_PYTHON: a python with lm-eval");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/lm_eval");
    let dir = common::scratch("lm-eval");
    std::fs::create_dir_all(&dir).unwrap();
    let task = |name: &str, body: &str| {
        std::fs::write(
            dir.join(format!("{name}.yaml")),
            format!("task: {name}\n{body}"),
        )
        .unwrap();
    };
    let file = |f: &str| data.join(f).display().to_string();
    task(
        "charm_mc",
        &format!(
            "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n\
             output_type: multiple_choice\ndoc_to_text: \"{{{{question}}}}\"\ndoc_to_choice: \"{{{{choices}}}}\"\n\
             doc_to_target: \"{{{{answer}}}}\"\nmetric_list:\n  - metric: acc\n",
            file("mc.jsonl")
        ),
    );
    task(
        "charm_gen",
        &format!(
            "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n\
             output_type: generate_until\ndoc_to_text: \"{{{{prompt}}}}\"\ndoc_to_target: \"{{{{target}}}}\"\n\
             generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 16\n  do_sample: false\n  temperature: 0\n\
             metric_list:\n  - metric: exact_match\n",
            file("gen.jsonl")
        ),
    );
    let s = Server::start(&[]);
    let run = |model: &str, route: &str, extra: &[&str], tasks: &str, out: &str| {
        let args = format!(
            "model=charm-bard-moe,base_url=http://{}/v1/{route},num_concurrent=4,max_retries=3",
            s.addr
        );
        let o = Command::new(&python)
            .args([
                "-m",
                "lm_eval",
                "--model",
                model,
                "--model_args",
                &args,
                "--tasks",
                tasks,
            ])
            .args([
                "--include_path",
                dir.to_str().unwrap(),
                "--log_samples",
                "--output_path",
            ])
            .arg(dir.join(out))
            .args(extra)
            .env("HF_DATASETS_OFFLINE", "1")
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "lm_eval {model}: {}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    };
    run(
        "local-completions",
        "completions",
        &["--batch_size", "8"],
        "charm_mc,charm_gen",
        "completions",
    );
    run(
        "local-chat-completions",
        "chat/completions",
        &["--apply_chat_template"],
        "charm_gen",
        "chat",
    );
    // the samples lm-eval logged, per task
    let samples = |out: &str, task: &str| -> Vec<Value> {
        let d = dir.join(out).join("charm-bard-moe");
        let f = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(&format!("samples_{task}_"))
            })
            .unwrap_or_else(|| panic!("no samples of {task} in {}", d.display()));
        std::fs::read_to_string(f)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    // loglikelihoods: lm-eval encodes context + continuation and splits at the context's tokens
    let e = Engine::load(&demo(), &EngineOptions::default()).unwrap();
    let tok = TextTokenizer::load(&demo()).unwrap();
    let mut checked = 0;
    for doc in samples("completions", "charm_mc") {
        for (i, resp) in doc["resps"].as_array().unwrap().iter().enumerate() {
            let arg = &doc["arguments"][format!("gen_args_{i}")];
            let (ctx, cont) = (
                arg["arg_0"].as_str().unwrap(),
                arg["arg_1"].as_str().unwrap(),
            );
            let whole = tok.encode(&format!("{ctx}{cont}")).unwrap();
            let n_ctx = tok.encode(ctx).unwrap().len();
            let v = e.model.spec.vocab_size;
            let mut cache = charm_coordinator::model::cache::KvCache::new(&e.model.spec);
            let h = e
                .model
                .forward(&whole, &mut cache, ForwardOptions::default(), None)
                .unwrap();
            let logits = e.model.logits(&h, whole.len()).unwrap();
            let mut ll = 0.0f64;
            for p in n_ctx..whole.len() {
                let row = &logits[(p - 1) * v..p * v];
                let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
                let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
                ll += row[whole[p] as usize] as f64 - m - z.ln();
            }
            let theirs: f64 = resp[0][0].as_str().unwrap().parse().unwrap();
            assert!(
                (theirs - ll).abs() < 1e-3,
                "{ctx:?} + {cont:?}: lm-eval {theirs}, charm {ll}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 15);
    // greedy texts: `charm generate`'s, cut at the stop string
    for doc in samples("completions", "charm_gen") {
        let prompt = doc["doc"]["prompt"].as_str().unwrap();
        let (ok, out, err) = common::charm(&[
            "generate",
            "--model",
            demo().to_str().unwrap(),
            "--prompt",
            prompt,
            "--max-tokens",
            "16",
            "--temperature",
            "0",
            "--json",
        ]);
        assert!(ok, "{err}");
        let text = common::json(out.lines().last().unwrap())["text"]
            .as_str()
            .unwrap()
            .to_string();
        let cut = text.split("\n\n").next().unwrap();
        assert_eq!(doc["resps"][0][0].as_str().unwrap(), cut, "{prompt:?}");
    }
    // chat: the chat API's greedy answers
    for doc in samples("chat", "charm_gen") {
        let prompt = doc["doc"]["prompt"].as_str().unwrap();
        let v = post(
            &s.addr,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": prompt}],
            "max_tokens": 16, "temperature": 0, "stop": ["\n\n"]}),
        )
        .json();
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(doc["resps"][0][0].as_str().unwrap(), answer, "{prompt:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_demo_serves_and_its_curl_line_works() {
    let (s, said) = Server::demo();
    let seen = said.join("\n");
    let curl = said.last().unwrap();
    assert!(curl.starts_with("curl "), "no curl line in: {seen}");
    assert!(seen.contains("the same tokens"), "{seen}");
    assert!(
        seen.contains(&format!("chat page and dashboard: http://{}/", s.addr)),
        "{seen}"
    );
    // the line's request as curl sends it: its URL and its -d body
    let url = curl.split_whitespace().nth(1).unwrap();
    let rest = url.strip_prefix("http://").unwrap();
    let (addr, path) = rest.split_at(rest.find('/').unwrap());
    assert_eq!(addr, s.addr);
    let body = curl.split(" -d '").nth(1).unwrap().trim_end_matches('\'');
    let r = http(
        &s.addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(!r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
}

/// The library's greedy decode of `prompt` with `pen` applied before each choice.
fn penalized_text(
    prompt: &str,
    n: usize,
    pen: charm_coordinator::decode::sampling::Penalties,
) -> String {
    use charm_coordinator::model::cache::KvCache;
    let e = Engine::load(&demo(), &EngineOptions::default()).unwrap();
    let tok = TextTokenizer::load(&demo()).unwrap();
    let m = &e.model;
    let p = tok.encode(prompt).unwrap();
    let h = m.spec.hidden_size;
    let mut cache = KvCache::new(&m.spec);
    let mut s = Sampler::new(SamplingParams::default());
    let normed = m
        .forward(&p, &mut cache, ForwardOptions::default(), None)
        .unwrap();
    let mut logits = m.logits(&normed[(p.len() - 1) * h..], 1).unwrap();
    let mut ids = Vec::new();
    loop {
        pen.apply(&mut logits, &p, &ids);
        let t = s.sample(&logits);
        if m.spec.eos_token_ids.contains(&t) {
            break;
        }
        ids.push(t);
        if ids.len() == n {
            break;
        }
        let normed = m
            .forward(&[t], &mut cache, ForwardOptions::default(), None)
            .unwrap();
        logits = m.logits(&normed, 1).unwrap();
    }
    tok.decode(&ids).unwrap()
}

#[test]
fn penalties_min_p_and_logprobs_behave_as_defined() {
    let s = Server::start(&[]);
    let pen = charm_coordinator::decode::sampling::Penalties {
        presence: 1.5,
        frequency: 0.5,
        repetition: 1.3,
    };
    let want = penalized_text("ROMEO. ", 30, pen);
    assert_ne!(
        want,
        greedy_text("ROMEO. ", 30),
        "the penalties change nothing here"
    );
    let v = post(
        &s.addr,
        "/v1/completions",
        &json!({"prompt": "ROMEO. ", "max_tokens": 30, "temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}),
    )
    .json();
    assert_eq!(v["choices"][0]["text"], want.as_str());

    // chat logprobs: one entry per token, the greedy choice on top, alternatives descending
    let v = post(
        &s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 3}),
    )
    .json();
    let c = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        c.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for e in c {
        let lp = e["logprob"].as_f64().unwrap();
        let top: Vec<f64> = e["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect();
        assert_eq!(top.len(), 3);
        assert!(lp <= 0.0 && (lp - top[0]).abs() < 1e-6, "{e}");
        assert!(top.windows(2).all(|w| w[0] >= w[1]), "{e}");
    }
    // completions' shape
    let v = post(
        &s.addr,
        "/v1/completions",
        &json!({"prompt": "ROMEO. ", "max_tokens": 5, "temperature": 0, "logprobs": 2}),
    )
    .json();
    let l = &v["choices"][0]["logprobs"];
    assert_eq!(l["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(l["token_logprobs"].as_array().unwrap().len(), 5);
    assert_eq!(l["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(l["text_offset"][0], 0);

    // streamed: each chunk carries its tokens' log probabilities, all of them in order
    let whole = post(
        &s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    )
    .json();
    let want: Vec<f64> = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["logprob"].as_f64().unwrap())
        .collect();
    let got: Vec<f64> = events(
        &post(
            &s.addr,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2, "stream": true}),
        )
        .body,
    )
    .iter()
    .filter(|e| *e != "[DONE]")
    .flat_map(|e| {
        let v: Value = serde_json::from_str(e).unwrap();
        v["choices"][0]["logprobs"]["content"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    })
    .map(|e| e["logprob"].as_f64().unwrap())
    .collect();
    assert_eq!(got, want);
    // min_p 1.0 keeps only the most likely token: greedy, whatever the temperature
    let v = post(
        &s.addr,
        "/v1/completions",
        &json!({"prompt": "ROMEO. ", "max_tokens": 20, "temperature": 1.5, "min_p": 1.0, "seed": 5}),
    )
    .json();
    assert_eq!(v["choices"][0]["text"], greedy_text("ROMEO. ", 20).as_str());
    for bad in [
        json!({"prompt": "x", "min_p": 2}),
        json!({"prompt": "x", "presence_penalty": 3}),
        json!({"prompt": "x", "repetition_penalty": 0}),
        json!({"prompt": "x", "logprobs": 50}),
    ] {
        assert_eq!(post(&s.addr, "/v1/completions", &bad).status, 400, "{bad}");
    }
}

/// `charm chat ARGS` with `input` on standard input: its standard output.
fn chat(args: &[&str], input: &str) -> String {
    let mut c = Command::new(env!("CARGO_BIN_EXE_charm"))
        .arg("chat")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn charm_chat_talks_to_a_local_model_and_to_a_server_alike() {
    let s = Server::start(&[]);
    let answer = |msgs: Value| chat_answer(&s.addr, &msgs, 16);
    let first = answer(json!([{"role": "user", "content": "Speak, Romeo."}]));
    let second_alone = answer(json!([{"role": "user", "content": "Who art thou?"}]));
    let second_after = answer(json!([
        {"role": "user", "content": "Speak, Romeo."},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Who art thou?"}
    ]));
    assert_ne!(
        second_alone, second_after,
        "the history changes nothing here"
    );
    let common = ["--max-tokens", "16", "--temperature", "0"];
    let model = demo();
    let local = [&["--model", model.to_str().unwrap()][..], &common].concat();
    let drafted = [&local[..], &["--draft", "3"]].concat();
    let url = format!("http://{}", s.addr);
    let remote = [&["--url", url.as_str()][..], &common].concat();
    for args in [&local, &drafted, &remote] {
        // two turns: the second sees the first
        let out = chat(args, "Speak, Romeo.\nWho art thou?\n");
        assert!(out.contains(&format!("> {first}\n[")), "{out}");
        assert!(out.contains(&format!("> {second_after}\n[")), "{out}");
        assert!(out.contains("tokens,") && out.contains("tok/s"), "{out}");
        // /reset forgets
        let out = chat(args, "Speak, Romeo.\n/reset\nWho art thou?\n/quit\n");
        assert!(out.contains("(conversation cleared)"), "{out}");
        assert!(out.contains(&format!("> {second_alone}\n[")), "{out}");
    }
}

#[test]
fn concurrent_requests_answer_exactly_as_one_at_a_time() {
    // batched, and with prompts read in chunks of 3 tokens between decode tokens
    for flags in [
        &["--parallel", "4"][..],
        &["--parallel", "4", "--batch-tokens", "3"],
    ] {
        concurrent_equals_alone(&Server::start(flags));
    }
}

fn concurrent_equals_alone(s: &Server) {
    let prompts = ["ROMEO. ", "JULIET.\n", "KING. What", "Enter a"];
    let ask = |p: &str, n: u64| json!({"prompt": p, "max_tokens": n, "temperature": 0.7, "seed": 11, "stream": true});
    let text = |r: Reply| -> String {
        events(&r.body)
            .iter()
            .filter(|e| *e != "[DONE]")
            .filter_map(|e| {
                serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"]
                    .as_str()
                    .map(String::from)
            })
            .collect()
    };
    // lengths differ so that sequences join and leave while others run
    let lens = [60u64, 20, 45, 5];
    let alone: Vec<String> = prompts
        .iter()
        .zip(lens)
        .map(|(p, n)| text(post(&s.addr, "/v1/completions", &ask(p, n))))
        .collect();
    // Four long generations (past EOS) fill every slot (`--parallel 4`): the requests queue
    // behind them, seen waiting all four, and start together when those clients leave, so that
    // they run together however slowly the machine starts their threads (and, their lengths
    // differing, still leave while others run). A blocker holds its slot from admission on,
    // even one whose prompt waits for room in a step (`--batch-tokens 3` with three decoding).
    let accepted = metric(&s.addr, "charm_requests_total");
    let blockers: Vec<TcpStream> = (0..4)
        .map(|_| send_stream(&s.addr, "Exeunt. ", 1000))
        .collect();
    wait_until("the four blockers admitted", || {
        metric(&s.addr, "charm_requests_total") >= accepted + 4.0
            && metric(&s.addr, "charm_queue_depth") == 0.0
    });
    let addr = s.addr.clone();
    let (together, steps_before): (Vec<String>, f64) = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .zip(lens)
            .map(|(p, n)| {
                let (a, b) = (addr.clone(), ask(p, n));
                sc.spawn(move || text(post(&a, "/v1/completions", &b)))
            })
            .collect();
        wait_until("all four requests waiting behind the blockers", || {
            metric(&addr, "charm_queue_depth") >= 4.0
        });
        let steps_before = metric(&addr, "charm_forward_steps_total");
        drop(blockers);
        (
            hs.into_iter().map(|h| h.join().unwrap()).collect(),
            steps_before,
        )
    });
    assert_eq!(together, alone);
    assert!(alone.iter().all(|t| !t.is_empty()));
    // one step serves every running sequence: far fewer steps than tokens generated (the steps
    // counted include the blockers' last ones; a step gives a sequence one token at most, so
    // this also says that the requests ran together)
    let steps = metric(&s.addr, "charm_forward_steps_total") - steps_before;
    let tokens: u64 = lens.iter().sum();
    assert!(
        steps < tokens as f64 * 0.75,
        "{steps} forward steps for {tokens} tokens: the requests never ran together"
    );
}

#[test]
fn speculative_serving_answers_exactly_as_plain_serving() {
    let plain = Server::start(&[]);
    let asks = [
        json!({"prompt": "ROMEO. ", "max_tokens": 48, "temperature": 0}),
        json!({"prompt": "KING. What", "max_tokens": 40, "temperature": 0.8, "seed": 5, "logprobs": 2}),
        json!({"prompt": "JULIET.\n", "max_tokens": 32, "temperature": 0, "presence_penalty": 0.5, "repetition_penalty": 1.2}),
    ];
    let answer = |addr: &str, a: &Value| {
        let r = post(addr, "/v1/completions", a).json();
        (
            r["choices"][0]["text"].clone(),
            r["choices"][0]["logprobs"].clone(),
            r["usage"].clone(),
        )
    };
    let want: Vec<_> = asks.iter().map(|a| answer(&plain.addr, a)).collect();
    for flags in [
        &["--parallel", "4", "--draft", "3"][..],
        &[
            "--parallel",
            "4",
            "--draft",
            "4",
            "--draft-fixed",
            "--batch-tokens",
            "5",
        ],
        &[
            "--parallel",
            "4",
            "--draft",
            "2",
            "--draft-source",
            "lookup",
            "--draft-fixed",
        ],
    ] {
        let s = Server::start(flags);
        for (a, w) in asks.iter().zip(&want) {
            let (text, lp, usage) = answer(&s.addr, a);
            assert_eq!((&text, &lp), (&w.0, &w.1), "{flags:?} {a}");
            assert_eq!(usage["completion_tokens"], w.2["completion_tokens"]);
        }
        // four concurrent streams of different lengths, each as alone
        concurrent_equals_alone(&s);
        let drafted = metric(&s.addr, "charm_draft_tokens_total");
        let accepted = metric(&s.addr, "charm_draft_accepted_tokens_total");
        assert!(
            drafted > 0.0 && accepted <= drafted,
            "{flags:?}: {accepted} of {drafted}"
        );
        if flags.contains(&"--draft-fixed") {
            // every request drafted: its usage says how many drafts were kept
            let (_, _, usage) = answer(&s.addr, &asks[0]);
            let d = &usage["completion_tokens_details"];
            assert!(d["accepted_prediction_tokens"].is_u64(), "{usage}");
            assert!(d["rejected_prediction_tokens"].is_u64(), "{usage}");
        }
    }
}

/// The content of a greedy chat answer of at most `max_tokens` tokens to `msgs`.
fn chat_answer(addr: &str, msgs: &Value, max_tokens: usize) -> String {
    post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": max_tokens, "temperature": 0}),
    )
    .json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn a_conversation_reuses_its_earlier_turns_and_answers_as_from_a_cold_prefill() {
    let warm = Server::start(&[]);
    let cold = Server::start(&["--prefix-cache-mb", "0"]);
    let ask = |addr: &str, msgs: &Value| chat_answer(addr, msgs, 24);
    let system =
        "You are a player in a company of actors, and you answer in verse, as the ".repeat(3);
    let mut msgs = json!([{"role": "system", "content": system}, {"role": "user", "content": "Speak, Romeo."}]);
    let first = ask(&warm.addr, &msgs);
    assert_eq!(first, ask(&cold.addr, &msgs));
    msgs.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": first}),
        json!({"role": "user", "content": "And then?"}),
    ]);
    let before = metric(&warm.addr, "charm_prefix_tokens_reused_total");
    let second = ask(&warm.addr, &msgs);
    let reused = metric(&warm.addr, "charm_prefix_tokens_reused_total") - before;
    assert!(reused >= 16.0, "nothing reused ({reused})");
    assert_eq!(second, ask(&cold.addr, &msgs));
    assert_eq!(metric(&cold.addr, "charm_prefix_tokens_reused_total"), 0.0);
}

#[test]
fn generation_config_adds_its_stop_tokens() {
    use charm_coordinator::serve::stop_token_ids;
    use charm_shared::config::ModelSpec;
    let spec = ModelSpec::from_dir(&demo()).unwrap();
    let ids = stop_token_ids(&demo(), &spec);
    assert_eq!(ids, spec.eos_token_ids);
    let d = common::scratch("gw-stops");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(demo().join("config.json"), d.join("config.json")).unwrap();
    std::fs::write(
        d.join("generation_config.json"),
        r#"{"eos_token_id": [7, 0, 9]}"#,
    )
    .unwrap();
    let ids = stop_token_ids(&d, &spec);
    assert!(ids.contains(&7) && ids.contains(&9));
    assert_eq!(ids.iter().filter(|&&t| t == 0).count(), 1);
    std::fs::write(d.join("generation_config.json"), r#"{"eos_token_id": 11}"#).unwrap();
    assert!(stop_token_ids(&d, &spec).contains(&11));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_template_that_opens_thinking_gets_the_reasoning_apart() {
    // the demo model with a template whose generation prompt opens `<think>`, as GLM's does
    let d = demo_with_template("gw-think", |t| {
        t.replace(
            "<|assistant|>\n{% endif -%}",
            "<|assistant|>\n<think>{% endif -%}",
        )
    });
    let s = Server::start_model(&d, &[]);
    let req = json!({"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 12, "temperature": 0});
    let v = post(&s.addr, "/v1/chat/completions", &req).json();
    let msg = &v["choices"][0]["message"];
    // this model never closes its thinking: everything is reasoning
    let reasoning = msg["reasoning_content"].as_str().unwrap().to_string();
    assert!(!reasoning.is_empty(), "{v}");
    assert_eq!(msg["content"], "");
    let mut st = req.clone();
    st["stream"] = json!(true);
    let (mut r, mut c) = (String::new(), String::new());
    for e in events(&post(&s.addr, "/v1/chat/completions", &st).body) {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        r += v["choices"][0]["delta"]["reasoning_content"]
            .as_str()
            .unwrap_or("");
        c += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
    }
    assert_eq!((r, c), (reasoning, String::new()));
    drop(s);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn tools_reach_a_template_that_defines_tool_calls() {
    // the demo model with a GLM-style template that lists the tools
    let d = demo_with_template("gw-tools", |t| {
        let tools = "{% if tools %}<|system|>\nCall tools as <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}";
        t.replacen("[gMASK]<sop>", &format!("[gMASK]<sop>{tools}"), 1)
    });
    let s = Server::start_model(&d, &[]);
    let tool = json!({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let ask = |tools: Option<Value>, stream: bool| {
        let mut b = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 6, "temperature": 0, "stream": stream});
        if let Some(t) = tools {
            b["tools"] = t;
        }
        post(&s.addr, "/v1/chat/completions", &b)
    };
    let plain = ask(None, false).json();
    let with = ask(Some(json!([tool])), false).json();
    // the tools were rendered into the prompt
    assert!(
        with["usage"]["prompt_tokens"].as_u64().unwrap()
            > plain["usage"]["prompt_tokens"].as_u64().unwrap() + 20,
        "{with} {plain}"
    );
    // this model calls none: a plain answer, streamed the same
    assert!(with["choices"][0]["message"].get("tool_calls").is_none());
    let streamed = streamed_content(&ask(Some(json!([tool])), true).body);
    assert_eq!(
        streamed,
        with["choices"][0]["message"]["content"].as_str().unwrap()
    );
    // Anthropic's tools and a history with a tool use and its result reach the template too
    let anth = |tools: bool| {
        let mut b = json!({"max_tokens": 6, "temperature": 0, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C"}]}
        ]});
        if tools {
            b["tools"] = json!([{"name": "get_weather", "description": "Weather of a city.", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
        }
        post(&s.addr, "/v1/messages", &b)
    };
    let (plain, with) = (anth(false), anth(true));
    assert_eq!(
        (plain.status, with.status),
        (200, 200),
        "{}",
        String::from_utf8_lossy(&with.body)
    );
    assert!(
        with.json()["usage"]["input_tokens"].as_u64().unwrap()
            > plain.json()["usage"]["input_tokens"].as_u64().unwrap() + 20
    );
    drop(s);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_server_killed_mid_conversation_resumes_it_from_its_kv_log() {
    let d = common::scratch("gw-kvlog");
    let _ = std::fs::remove_dir_all(&d);
    let kv = d.to_str().unwrap();
    let cold = Server::start(&["--prefix-cache-mb", "0"]);
    let ask = |addr: &str, msgs: &Value| chat_answer(addr, msgs, 24);
    let system = "You are a player in a company of actors, and you answer in verse. ".repeat(3);
    let mut msgs = json!([{"role": "system", "content": system}, {"role": "user", "content": "Speak, Romeo."}]);
    let first = {
        let a = Server::start(&["--kv-dir", kv]);
        let before = metric(&a.addr, "charm_kv_log_bytes");
        let first = ask(&a.addr, &msgs);
        // the finished conversation goes to the log just after its answer
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while metric(&a.addr, "charm_kv_log_bytes") <= before {
            assert!(
                std::time::Instant::now() < deadline,
                "the conversation never reached the log"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        first
        // dropped: killed with SIGKILL
    };
    // and a write the crash cut short: half a record at the end of the log
    let log = d.join("kv.log");
    let whole = std::fs::metadata(&log).unwrap().len();
    let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
    f.write_all(&[0x43, 0x4b, 0x56, 0x52, 0x00, 0x10, 0, 0, 0, 0, 0, 0, 7, 7])
        .unwrap();
    drop(f);
    let b = Server::start(&["--kv-dir", kv]);
    assert_eq!(
        std::fs::metadata(&log).unwrap().len(),
        whole,
        "the torn tail was not cut"
    );
    msgs.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": first}),
        json!({"role": "user", "content": "And then?"}),
    ]);
    let second = ask(&b.addr, &msgs);
    let reused = metric(&b.addr, "charm_prefix_tokens_reused_total");
    assert!(
        reused >= 16.0,
        "the restarted server reused nothing ({reused})"
    );
    assert_eq!(second, ask(&cold.addr, &msgs));
    // a log of other activations (other KV) is refused, not misread
    let out = Command::new(env!("CARGO_BIN_EXE_charm"))
        .args(["serve", "--model"])
        .arg(demo())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--activations",
            "int8",
            "--kv-dir",
            kv,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another model"), "{err}");
    drop(b);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn ignore_eos_generates_past_the_end_of_sequence_tokens() {
    // a demo copy whose generation_config ends generations at the first token greedy picks
    let s = Server::start(&[]);
    let ask = |addr: &str, extra: Value| {
        let mut b = json!({"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        post(addr, "/v1/completions", &b).json()
    };
    let lp = ask(&s.addr, json!({"logprobs": 1}));
    let first = TextTokenizer::load(&demo())
        .unwrap()
        .encode(lp["choices"][0]["logprobs"]["tokens"][0].as_str().unwrap())
        .unwrap();
    let d = common::scratch("gw-ignore-eos");
    std::fs::create_dir_all(&d).unwrap();
    for f in std::fs::read_dir(demo()).unwrap() {
        let f = f.unwrap().path();
        let name = f.file_name().unwrap().to_owned();
        if name != "generation_config.json" {
            std::os::unix::fs::symlink(&f, d.join(name)).unwrap();
        }
    }
    std::fs::write(
        d.join("generation_config.json"),
        json!({"eos_token_id": [first[0]]}).to_string(),
    )
    .unwrap();
    let s = Server::start_model(&d, &[]);
    let stopped = ask(&s.addr, json!({}));
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop", "{stopped}");
    assert_eq!(stopped["usage"]["completion_tokens"], 0);
    let on = ask(&s.addr, json!({"ignore_eos": true}));
    assert_eq!(on["choices"][0]["finish_reason"], "length", "{on}");
    assert_eq!(on["usage"]["completion_tokens"], 12);
    assert_eq!(on["choices"][0]["text"], lp["choices"][0]["text"]);
    let bad = post(
        &s.addr,
        "/v1/completions",
        &json!({"prompt": "a", "ignore_eos": 1}),
    );
    assert_eq!(bad.status, 400);
    drop(s);
    std::fs::remove_dir_all(&d).unwrap();
}

/// The log-softmax of one pass over `ids` (what `charm logits` computes): row `i` is the
/// distribution of the token after `ids[i]`.
fn log_softmax_rows(ids: &[u32]) -> Vec<Vec<f32>> {
    let e = Engine::load(&demo(), &EngineOptions::default()).unwrap();
    let m = &e.model;
    let mut cache = charm_coordinator::model::cache::KvCache::new(&m.spec);
    let normed = m
        .forward(ids, &mut cache, ForwardOptions::default(), None)
        .unwrap();
    let l = m.logits(&normed, ids.len()).unwrap();
    l.chunks_exact(m.spec.vocab_size)
        .map(|r| {
            let max = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z = r.iter().map(|x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32 + max;
            r.iter().map(|x| x - z).collect()
        })
        .collect()
}

#[test]
fn echo_n_model_names_token_counts_and_tokenize_answer_as_specified() {
    let s = Server::start(&[]);
    let a = s.addr.as_str();
    let tok = TextTokenizer::load(&demo()).unwrap();

    // a model the server does not serve: 404 naming the one it does; its directory name is fine
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": "gpt-4o", "prompt": "ROMEO.", "max_tokens": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4o", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
        ),
        (
            "/v1/messages",
            json!({"model": "claude", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
        ),
        ("/tokenize", json!({"model": "x", "content": "Hi"})),
    ] {
        let r = post(a, path, &body);
        assert_eq!(r.status, 404, "{path}");
        let msg = r.json().to_string();
        assert!(msg.contains("charm-bard-moe"), "{path}: {msg}");
    }
    let ok = post(
        a,
        "/v1/completions",
        &json!({"model": "charm-bard-moe", "prompt": "ROMEO.", "max_tokens": 2}),
    );
    assert_eq!(ok.status, 200);

    // echo with logprobs and max_tokens 0: the prompt's log probabilities as one pass computes them
    let prompt = "ROMEO. What light through yonder window breaks?";
    let ids = tok.encode(prompt).unwrap();
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 2, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    let c = &v["choices"][0];
    assert_eq!(c["text"], prompt);
    assert_eq!(v["usage"]["completion_tokens"], 0);
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    let lp = &c["logprobs"];
    let got = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(got.len(), ids.len());
    assert!(got[0].is_null() && lp["top_logprobs"][0].is_null());
    let rows = log_softmax_rows(&ids);
    for i in 1..ids.len() {
        let want = rows[i - 1][ids[i] as usize];
        let g = got[i].as_f64().unwrap() as f32;
        assert!((g - want).abs() <= 1e-5, "token {i}: {g} vs {want}");
        // the top 2 and, beside them, the prompt's own token
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(top.len() <= 3, "{top:?}");
        assert!(top.contains_key(&tok.decode(&[ids[i]]).unwrap()), "{top:?}");
    }
    let texts: Vec<String> = ids.iter().map(|&t| tok.decode(&[t]).unwrap()).collect();
    assert_eq!(lp["tokens"], json!(texts));
    // with a completion: the prompt, then the completion, and the completion's entries after
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 5, "echo": true, "logprobs": 0, "temperature": 0}),
    )
    .json();
    let plain = post(
        a,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 5, "temperature": 0}),
    )
    .json();
    let done = plain["choices"][0]["text"].as_str().unwrap();
    assert_eq!(r["choices"][0]["text"], format!("{prompt}{done}"));
    assert_eq!(
        r["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        ids.len() + 5
    );
    // max_tokens 0 without echo is still refused
    assert_eq!(
        post(
            a,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 0})
        )
        .status,
        400
    );

    // n: 3 with a seed is the three requests with seed, seed + 1, seed + 2; whole and streamed
    let body = |seed: u64, n: usize, stream: bool| json!({"prompt": "ROMEO.", "max_tokens": 12, "temperature": 1.0, "seed": seed, "n": n, "stream": stream});
    let three = post(a, "/v1/completions", &body(41, 3, false)).json();
    let ch = three["choices"].as_array().unwrap();
    assert_eq!(ch.len(), 3);
    let mut singles = Vec::new();
    for i in 0..3 {
        assert_eq!(ch[i]["index"], i);
        let one = post(a, "/v1/completions", &body(41 + i as u64, 1, false)).json();
        singles.push(one["choices"][0]["text"].as_str().unwrap().to_string());
        assert_eq!(ch[i]["text"], singles[i], "choice {i}");
    }
    assert!(
        singles[0] != singles[1] || singles[1] != singles[2],
        "three seeds, one answer"
    );
    assert_eq!(three["usage"]["completion_tokens"], 36);
    let streamed = post(a, "/v1/completions", &body(41, 3, true));
    let mut texts = vec![String::new(); 3];
    let evs = events(&streamed.body);
    assert_eq!(evs.last().unwrap(), "[DONE]");
    for e in &evs[..evs.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            texts[c["index"].as_u64().unwrap() as usize] += c["text"].as_str().unwrap();
        }
    }
    assert_eq!(texts, singles);
    // chat too
    let chat = post(a, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 8, "n": 2, "seed": 3})).json();
    let one = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 8, "seed": 4}),
    )
    .json();
    assert_eq!(
        chat["choices"][1]["message"]["content"],
        one["choices"][0]["message"]["content"]
    );
    assert_eq!(
        post(a, "/v1/completions", &body(1, 9, false)).status,
        400,
        "n beyond --parallel"
    );

    // count_tokens is the input_tokens of the same Messages request
    let msgs = json!([{"role": "user", "content": "Speak, Romeo."}]);
    let counted = post(
        a,
        "/v1/messages/count_tokens",
        &json!({"model": "charm-bard-moe", "system": "Be brief.", "messages": msgs}),
    )
    .json();
    let m = post(a, "/v1/messages", &json!({"model": "charm-bard-moe", "max_tokens": 3, "system": "Be brief.", "messages": msgs})).json();
    assert_eq!(counted["input_tokens"], m["usage"]["input_tokens"]);
    assert!(counted["input_tokens"].as_u64().unwrap() > 5);

    // tokenize and detokenize round trip; out-of-vocabulary ids are a 400
    let t = post(a, "/tokenize", &json!({"content": prompt})).json();
    assert_eq!(t["tokens"], json!(ids));
    let pieces = post(
        a,
        "/tokenize",
        &json!({"content": prompt, "with_pieces": true}),
    )
    .json();
    assert_eq!(pieces["tokens"][0]["piece"], texts_of(&tok, &ids)[0]);
    let d = post(a, "/detokenize", &json!({"tokens": ids})).json();
    assert_eq!(d["content"], prompt);
    assert_eq!(
        post(a, "/detokenize", &json!({"tokens": [u32::MAX]})).status,
        400
    );
    assert_eq!(
        post(
            a,
            "/v1/completions",
            &json!({"prompt": [1, 2, 99999999], "max_tokens": 1})
        )
        .status,
        400
    );
}

fn texts_of(tok: &TextTokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter().map(|&t| tok.decode(&[t]).unwrap()).collect()
}

#[test]
fn slow_clients_are_timed_out_and_open_connections_are_capped() {
    let s = Server::start(&["--read-timeout", "1", "--max-connections", "8"]);
    let a = s.addr.as_str();
    // 40 connections send part of a request's headers and then nothing
    let mut held: Vec<TcpStream> = (0..40)
        .map(|_| {
            let mut c = TcpStream::connect(a).unwrap();
            c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                .unwrap();
            c
        })
        .collect();
    // all are closed: those past the cap at once, the others when their headers are late
    for c in &mut held {
        c.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        let mut b = Vec::new();
        let _ = c.read_to_end(&mut b);
        assert!(
            b.is_empty() || String::from_utf8_lossy(&b).starts_with("HTTP/1.1 408"),
            "{}",
            String::from_utf8_lossy(&b)
        );
    }
    assert!(metric(a, "charm_connections_refused_total") >= 32.0);
    // a body that stops coming: 408
    let r = raw_answer(
        a,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro",
    );
    assert!(r.starts_with("HTTP/1.1 408"), "{r}");
    // an idle keep-alive connection is closed too
    let r = raw_answer(a, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    // and the server still answers
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": "ROMEO.", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200);
}

/// What the server answers to `request`, sent as it is on a fresh connection, read until the
/// server closes the connection (20 s at most).
fn raw_answer(addr: &str, request: &[u8]) -> String {
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(request).unwrap();
    c.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let mut b = Vec::new();
    let _ = c.read_to_end(&mut b);
    String::from_utf8_lossy(&b).into_owned()
}

/// The demo model with one of the real chat templates in tests/data/templates.
fn demo_with_real_template(name: &str) -> PathBuf {
    demo_with_real_template_as(name, name)
}

/// [`demo_with_real_template`] in a directory of its own, `tag` (tests run at once in one
/// process: each needs its own).
fn demo_with_real_template_as(name: &str, tag: &str) -> PathBuf {
    let t = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/templates/{name}.jinja")),
    )
    .unwrap();
    demo_with_template(&format!("gw-{tag}"), |_| t)
}

fn completion_text(a: &str, body: &Value) -> (String, String) {
    let r = post(a, "/v1/completions", body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
    )
}

#[test]
fn structured_output_follows_schemas_grammars_and_regexes() {
    let s = Server::start(&[]);
    let a = s.addr.as_str();
    // a schema: the answer parses and has the fields, greedy and sampled, streamed the same
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]}},
        "required": ["name", "age", "kind"], "additionalProperties": false});
    for seed in 0..6 {
        let body = json!({"messages": [{"role": "user", "content": "A pet?"}], "max_tokens": 60,
            "temperature": if seed == 0 { 0.0 } else { 1.0 }, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": true}}});
        let r = post(a, "/v1/chat/completions", &body).json();
        let text = r["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["name"].as_str().unwrap().chars().count() <= 12, "{text}");
        assert!(v["age"].as_u64().unwrap() <= 120, "{text}");
        assert!(v["kind"] == "cat" || v["kind"] == "dog", "{text}");
        assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let streamed = streamed_content(&post(a, "/v1/chat/completions", &sb).body);
        assert_eq!(streamed, text);
    }
    // json_object: some object
    let r = post(a, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}})).json();
    // (no schema bounds it: a small model may run to max_tokens inside a string)
    let t = r["choices"][0]["message"]["content"].as_str().unwrap();
    match r["choices"][0]["finish_reason"].as_str().unwrap() {
        "stop" => assert!(serde_json::from_str::<Value>(t).unwrap().is_object(), "{t}"),
        _ => assert!(t.starts_with('{'), "{t}"),
    }

    // a regex, a Lark grammar and a GBNF grammar: the answers match them
    let (t, f) = completion_text(
        a,
        &json!({"prompt": "ROMEO. ", "max_tokens": 20, "temperature": 1.0, "seed": 4, "guided_regex": "[A-Z][a-z]{1,8} [0-9]{3}"}),
    );
    assert_eq!(f, "stop");
    let (w, n) = t.split_once(' ').unwrap();
    assert!(
        w.chars().next().unwrap().is_ascii_uppercase()
            && w[1..].chars().all(|c| c.is_ascii_lowercase()),
        "{t}"
    );
    assert!(n.len() == 3 && n.chars().all(|c| c.is_ascii_digit()), "{t}");
    let (t, _) = completion_text(
        a,
        &json!({"prompt": "ROMEO. ", "max_tokens": 30, "temperature": 1.0, "seed": 2, "guided_grammar": "start: (\"yes\" | \"no\") \", \" WORD \".\"\nWORD: /[a-z]{1,10}/"}),
    );
    assert!(
        (t.starts_with("yes, ") || t.starts_with("no, ")) && t.ends_with('.'),
        "{t}"
    );
    let (t, _) = completion_text(
        a,
        &json!({"prompt": "ROMEO. ", "max_tokens": 30, "temperature": 1.0, "seed": 3, "grammar": "root ::= answer \"!\"\nanswer ::= (\"ay\" | \"nay\") [0-9]{1,2}\n"}),
    );
    assert!(
        t.ends_with('!') && (t.starts_with("ay") || t.starts_with("nay")),
        "{t}"
    );
    let (t, _) = completion_text(
        a,
        &json!({"prompt": "ROMEO. ", "max_tokens": 10, "temperature": 1.0, "seed": 3, "guided_choice": ["Montague", "Capulet"]}),
    );
    assert!(t == "Montague" || t == "Capulet", "{t}");

    // constrained greedy equals unconstrained greedy where the free answer already fits
    let free = post(
        a,
        "/v1/completions",
        &json!({"prompt": "ROMEO. ", "max_tokens": 16, "temperature": 0}),
    )
    .json();
    let free_text = free["choices"][0]["text"].as_str().unwrap().to_string();
    let escaped: String = free_text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == ' ' {
                c.to_string()
            } else {
                format!("\\x{{{:x}}}", c as u32)
            }
        })
        .collect();
    for (k, v) in [
        ("guided_regex", json!(format!("{escaped}|[0-9]+"))),
        ("guided_choice", json!([free_text.clone(), "Nay."])),
    ] {
        let (t, f) = completion_text(
            a,
            &json!({"prompt": "ROMEO. ", "max_tokens": 16, "temperature": 0, k: v}),
        );
        assert_eq!(t, free_text, "{k}");
        assert_eq!(f, "stop", "{k}: the grammar ends where the free answer did");
    }

    // refusals name the reason
    for (k, v, needle) in [
        ("guided_json", json!({"type": "strin"}), "strin"),
        ("guided_grammar", json!("start: \"a\" | ("), "Expected"),
        ("guided_regex", json!("(ab"), "regex"),
        ("grammar", json!("answer ::= \"x\""), "root"),
    ] {
        let r = post(
            a,
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 4, k: v}),
        );
        assert_eq!(r.status, 400, "{k}");
        let m = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(m.contains(needle), "{k}: {m}");
    }
    let both = post(
        a,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 4, "guided_regex": "a", "guided_json": {}}),
    );
    assert_eq!(both.status, 400);
    assert!(metric(a, "charm_grammar_masks_total") > 0.0);
}

#[test]
fn forced_drafts_on_and_off_give_the_same_tokens_in_fewer_steps() {
    let on = Server::start(&[]);
    let off = Server::start(&["--no-forced-drafts"]);
    let schema = json!({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 16},
        "act": {"type": "integer", "minimum": 1, "maximum": 5},
        "scene": {"type": "integer", "minimum": 1, "maximum": 9},
        "speakers": {"type": "array", "items": {"enum": ["Romeo", "Juliet", "Nurse"]}, "minItems": 1, "maxItems": 3}},
        "required": ["title", "act", "scene", "speakers"], "additionalProperties": false});
    for seed in 0..4 {
        let body = json!({"prompt": "ROMEO. ", "max_tokens": 80, "temperature": if seed == 0 { 0.0 } else { 0.9 }, "seed": seed, "guided_json": schema, "logprobs": 1});
        let x = post(&on.addr, "/v1/completions", &body).json();
        let y = post(&off.addr, "/v1/completions", &body).json();
        assert_eq!(
            x["choices"][0]["text"], y["choices"][0]["text"],
            "seed {seed}"
        );
        assert_eq!(
            x["choices"][0]["logprobs"], y["choices"][0]["logprobs"],
            "seed {seed}"
        );
        assert_eq!(x["usage"], y["usage"]);
    }
    let steps = |a: &str| metric(a, "charm_forward_steps_total");
    let forced = metric(&on.addr, "charm_forced_accepted_tokens_total");
    assert!(forced > 20.0, "{forced}");
    assert_eq!(metric(&off.addr, "charm_forced_tokens_total"), 0.0);
    assert!(
        steps(&on.addr) * 2.0 < steps(&off.addr),
        "{} {} {forced}",
        steps(&on.addr),
        steps(&off.addr)
    );
    // with MTP-or-lookup drafts too: the same tokens
    let spec = Server::start(&["--draft", "3"]);
    let body = json!({"prompt": "ROMEO. ", "max_tokens": 80, "temperature": 0.9, "seed": 7, "guided_json": schema});
    assert_eq!(
        post(&spec.addr, "/v1/completions", &body).json()["choices"][0]["text"],
        post(&off.addr, "/v1/completions", &body).json()["choices"][0]["text"]
    );
    // and n choices each follow the grammar, choice i as seed + i
    let mut nb = body.clone();
    nb["n"] = json!(2);
    let two = post(&on.addr, "/v1/completions", &nb).json();
    let mut second = body.clone();
    second["seed"] = json!(8);
    assert_eq!(
        two["choices"][1]["text"],
        post(&off.addr, "/v1/completions", &second).json()["choices"][0]["text"]
    );
}

#[test]
fn a_required_or_named_tool_choice_gets_calls_in_the_templates_own_syntax() {
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "set_alarm", "description": "An alarm.",
            "parameters": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "label": {"enum": ["wake", "nap"]}}, "required": ["hour", "label"]}}}
    ]);
    for template in ["GLM-5.2", "Qwen-Qwen3-0.6B"] {
        let d = demo_with_real_template_as(template, &format!("{template}-tools"));
        let s = Server::start_model(&d, &[]);
        let a = s.addr.as_str();
        for (choice, want) in [
            (json!("required"), None),
            (
                json!({"type": "function", "function": {"name": "set_alarm"}}),
                Some("set_alarm"),
            ),
            (
                json!({"type": "function", "function": {"name": "get_weather"}}),
                Some("get_weather"),
            ),
        ] {
            for seed in 0..3 {
                let body = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "tool_choice": choice,
                    "max_tokens": 120, "temperature": if seed == 0 { 0.0 } else { 1.0 }, "seed": seed,
                    "chat_template_kwargs": {"enable_thinking": false}});
                let r = post(a, "/v1/chat/completions", &body);
                assert_eq!(
                    r.status,
                    200,
                    "{template}: {}",
                    String::from_utf8_lossy(&r.body)
                );
                let v = r.json();
                let c = &v["choices"][0];
                // a named tool: one call, then the end of the turn; `required`: calls until the
                // model ends, or max_tokens cuts the last one (left out, `length`)
                let finish = c["finish_reason"].as_str().unwrap();
                if want.is_some() {
                    assert_eq!(finish, "tool_calls", "{template} {choice}: {v}");
                } else {
                    assert!(finish == "tool_calls" || finish == "length", "{v}");
                }
                no_template_text(&c["message"]["content"], template);
                let calls = c["message"]["tool_calls"].as_array().unwrap();
                assert!(!calls.is_empty());
                if want.is_some() {
                    assert_eq!(calls.len(), 1, "{template} {choice}: {v}");
                }
                for call in calls {
                    let name = call["function"]["name"].as_str().unwrap();
                    if let Some(w) = want {
                        assert_eq!(name, w);
                    }
                    let args: Value =
                        serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
                            .unwrap();
                    match name {
                        "get_weather" => {
                            assert!(args["city"].is_string(), "{template}: {args}");
                            assert!((1..=7).contains(&args["days"].as_u64().unwrap()), "{args}");
                        }
                        "set_alarm" => {
                            assert!(args["hour"].as_u64().unwrap() <= 23, "{args}");
                            assert!(args["label"] == "wake" || args["label"] == "nap", "{args}");
                        }
                        n => panic!("{template}: unknown tool {n}"),
                    }
                }
            }
        }
        // `required` without parallel calls: exactly one, then the end of the turn
        let one = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "tool_choice": "required",
            "parallel_tool_calls": false, "max_tokens": 120, "temperature": 1.0, "seed": 5,
            "chat_template_kwargs": {"enable_thinking": false}});
        let v = post(a, "/v1/chat/completions", &one).json();
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{template}: {v}");
        assert_eq!(
            c["message"]["tool_calls"].as_array().unwrap().len(),
            1,
            "{v}"
        );
        // max_tokens cuts the call: `length`, and no template syntax in the content, whole or
        // streamed
        let mut cut = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 6,
            "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": false}});
        let v = post(a, "/v1/chat/completions", &cut).json();
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "length", "{template}: {v}");
        assert!(c["message"]["tool_calls"].is_null(), "{v}");
        no_template_text(&c["message"]["content"], template);
        cut["stream"] = json!(true);
        let events: Vec<Value> = events(&post(a, "/v1/chat/completions", &cut).body)
            .iter()
            .filter(|e| e.as_str() != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let finish: Vec<&Value> = events
            .iter()
            .map(|e| &e["choices"][0]["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finish, vec![&json!("length")], "{template}: {events:?}");
        let streamed: String = events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect();
        no_template_text(&json!(streamed), template);
        // Anthropic's any and tool
        let an = json!([{"name": "set_alarm", "description": "An alarm.", "input_schema": tools[1]["function"]["parameters"]}]);
        let r = post(a, "/v1/messages", &json!({"max_tokens": 4, "messages": [{"role": "user", "content": "Wake me."}], "tools": an, "tool_choice": {"type": "any"}})).json();
        assert_eq!(r["stop_reason"], "max_tokens", "{template}: {r}");
        for b in r["content"].as_array().unwrap() {
            assert_ne!(b["type"], "tool_use", "{r}");
            no_template_text(&b["text"], template);
        }
        for choice in [
            json!({"type": "any"}),
            json!({"type": "tool", "name": "set_alarm"}),
        ] {
            let r = post(a, "/v1/messages", &json!({"max_tokens": 200, "messages": [{"role": "user", "content": "Wake me."}], "tools": an, "tool_choice": choice})).json();
            // `any`: calls until the model ends or max_tokens cuts the last (left out)
            if choice["type"] == "any" && r["stop_reason"] == "max_tokens" {
                for b in r["content"].as_array().unwrap() {
                    no_template_text(&b["text"], template);
                }
            } else {
                assert_eq!(r["stop_reason"], "tool_use", "{template}: {r}");
            }
            let used: Vec<&Value> = r["content"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|b| b["type"] == "tool_use")
                .collect();
            assert_eq!(used[0]["name"], "set_alarm");
            assert!(used[0]["input"]["hour"].as_u64().unwrap() <= 23, "{r}");
        }
        let r = post(
            a,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}, "max_tokens": 5}),
        );
        assert_eq!(r.status, 400);
        drop(s);
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn anthropic_messages_put_a_thinking_templates_reasoning_in_thinking_blocks() {
    let d = demo_with_real_template_as("GLM-5.2", "GLM-5.2-thinking");
    let s = Server::start_model(&d, &[]);
    let a = s.addr.as_str();
    let ask = json!([{"role": "user", "content": "Speak, Romeo."}]);
    // the same turn through chat completions: its reasoning and its answer
    let openai = |on: bool| {
        let v = post(
            a,
            "/v1/chat/completions",
            &json!({"messages": ask, "max_tokens": 60, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": on}}),
        )
        .json();
        let m = &v["choices"][0]["message"];
        (
            m["reasoning_content"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            m["content"].as_str().unwrap().to_string(),
        )
    };
    let (reasoning, answer) = openai(true);
    assert!(
        !reasoning.is_empty(),
        "the template's thinking gave no reasoning"
    );
    let on = json!({"max_tokens": 60, "temperature": 0, "messages": ask,
        "thinking": {"type": "enabled", "budget_tokens": 1024}});
    let r = post(a, "/v1/messages", &on).json();
    let blocks = r["content"].as_array().unwrap();
    assert_eq!(blocks[0]["type"], "thinking", "{r}");
    assert_eq!(blocks[0]["thinking"], reasoning.as_str(), "{r}");
    assert!(blocks[0]["signature"].is_string(), "{r}");
    let text: String = blocks.iter().filter_map(|b| b["text"].as_str()).collect();
    assert_eq!(text, answer, "{r}");
    for b in blocks {
        assert!(
            !b["text"].as_str().unwrap_or_default().contains("<think>"),
            "{r}"
        );
    }
    // streamed: a thinking block, then a text block, with the same text
    let mut st = on.clone();
    st["stream"] = json!(true);
    let body = post(a, "/v1/messages", &st).body;
    let evs: Vec<Value> = String::from_utf8_lossy(&body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    let starts: Vec<(u64, String)> = evs
        .iter()
        .filter(|e| e["type"] == "content_block_start")
        .map(|e| {
            (
                e["index"].as_u64().unwrap(),
                e["content_block"]["type"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        starts,
        vec![(0, "thinking".to_string()), (1, "text".to_string())],
        "{evs:?}"
    );
    let delta = |kind: &str, field: &str| -> String {
        evs.iter()
            .filter(|e| e["type"] == "content_block_delta" && e["delta"]["type"] == kind)
            .filter_map(|e| e["delta"][field].as_str())
            .collect()
    };
    assert_eq!(delta("thinking_delta", "thinking"), reasoning);
    assert_eq!(delta("text_delta", "text"), answer);
    let stops = evs
        .iter()
        .filter(|e| e["type"] == "content_block_stop")
        .count();
    assert_eq!(stops, 2, "{evs:?}");
    // thinking off: the template's own switch, no thinking block
    let (_, plain) = openai(false);
    let off = json!({"max_tokens": 60, "temperature": 0, "messages": ask, "thinking": {"type": "disabled"}});
    let r = post(a, "/v1/messages", &off).json();
    let blocks = r["content"].as_array().unwrap();
    assert!(blocks.iter().all(|b| b["type"] == "text"), "{r}");
    assert_eq!(blocks[0]["text"], plain.as_str(), "{r}");
    // a bad switch is refused
    let bad = json!({"max_tokens": 5, "messages": ask, "thinking": {"type": "sometimes"}});
    assert_eq!(post(a, "/v1/messages", &bad).status, 400);
    drop(s);
    std::fs::remove_dir_all(&d).unwrap();
}

/// Panics where a message's content carries tool-call template syntax.
fn no_template_text(content: &Value, template: &str) {
    let text = content.as_str().unwrap_or_default();
    for mark in ["<tool_call>", "<arg_key>", "<arg_value>", "</tool_call>"] {
        assert!(
            !text.contains(mark),
            "{template}: template text in content: {text:?}"
        );
    }
}

/// The text of each choice of a completions answer.
fn choice_texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .unwrap_or_else(|| panic!("no choices: {v}"))
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn unseeded_requests_draw_fresh_seeds_and_seeded_ones_repeat() {
    let s = Server::start(&[]);
    let a = s.addr.as_str();
    let body = |seed: Option<u64>, n: usize| {
        let mut b = json!({"prompt": "ROMEO. ", "max_tokens": 24, "temperature": 1.0, "n": n, "ignore_eos": true});
        if let Some(seed) = seed {
            b["seed"] = json!(seed);
        }
        b
    };
    // four unseeded requests: at 24 sampled tokens each, four equal answers would mean one seed
    let unseeded: Vec<String> = (0..4)
        .map(|_| choice_texts(&post(a, "/v1/completions", &body(None, 1)).json()).remove(0))
        .collect();
    let mut distinct = unseeded.clone();
    distinct.sort();
    distinct.dedup();
    assert!(distinct.len() >= 3, "unseeded answers repeat: {unseeded:?}");
    // n without a seed: the choices differ too
    let two = choice_texts(&post(a, "/v1/completions", &body(None, 2)).json());
    assert_ne!(two[0], two[1]);
    // a seed still gives the same answer every time, and choice i of n is seed + i
    let seeded = choice_texts(&post(a, "/v1/completions", &body(Some(9), 1)).json());
    assert_eq!(
        seeded,
        choice_texts(&post(a, "/v1/completions", &body(Some(9), 1)).json())
    );
    let three = choice_texts(&post(a, "/v1/completions", &body(Some(8), 3)).json());
    assert_eq!(three[1], seeded[0]);
    // chat likewise
    let chat = |seed: Option<u64>| {
        let mut b = json!({"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 24, "temperature": 1.0, "ignore_eos": true});
        if let Some(seed) = seed {
            b["seed"] = json!(seed);
        }
        post(a, "/v1/chat/completions", &b).json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let chats: Vec<String> = (0..3).map(|_| chat(None)).collect();
    assert!(
        chats[0] != chats[1] || chats[1] != chats[2],
        "unseeded chat answers repeat: {chats:?}"
    );
    assert_eq!(chat(Some(5)), chat(Some(5)));
}

#[test]
fn models_retrieve_logprobs_carry_the_sampled_token_and_a_large_body_is_refused_at_once() {
    let s = Server::start(&["--name", "org/charm-bard"]);
    let a = s.addr.as_str();
    // the SDKs' models.retrieve: the model object, by its name (a `/` in it) or directory name
    for id in ["org/charm-bard", "charm-bard-moe"] {
        let m = http(a, "GET", &format!("/v1/models/{id}"), &[], b"");
        assert_eq!(m.status, 200, "{id}");
        let m = m.json();
        assert_eq!(
            (m["id"].clone(), m["object"].clone(), m["owned_by"].clone()),
            (json!("org/charm-bard"), json!("model"), json!("charm"))
        );
        assert!(m["created"].is_u64());
    }
    let gone = http(a, "GET", "/v1/models/gpt-4o", &[], b"");
    assert_eq!(gone.status, 404);
    let e = &gone.json()["error"];
    assert_eq!(e["type"], "invalid_request_error");
    assert_eq!(e["code"], "model_not_found");
    assert!(e["message"].as_str().unwrap().contains("gpt-4o"));

    // logprobs: N: beside the top N, the sampled token itself (up to N + 1 entries), with the
    // log probability `token_logprobs` gives it; the echoed prompt's tokens likewise
    for echo in [false, true] {
        let v = post(
            a,
            "/v1/completions",
            &json!({"prompt": "ROMEO. Speak", "max_tokens": 16, "temperature": 1.0, "seed": 3, "logprobs": 1, "echo": echo}),
        )
        .json();
        let lp = &v["choices"][0]["logprobs"];
        let tokens = lp["tokens"].as_array().unwrap();
        let mut beside = 0;
        for (i, t) in tokens.iter().enumerate() {
            let top = &lp["top_logprobs"][i];
            if echo && i == 0 {
                assert!(top.is_null());
                continue;
            }
            let top = top.as_object().unwrap();
            assert!((1..=2).contains(&top.len()), "{top:?}");
            let got = top[t.as_str().unwrap()].as_f64().unwrap();
            let want = lp["token_logprobs"][i].as_f64().unwrap();
            assert!((got - want).abs() < 1e-6, "token {i}: {got} vs {want}");
            beside += usize::from(top.len() == 2);
        }
        // at temperature 1 some sampled tokens are not the most likely one
        assert!(beside > 0, "echo {echo}: {lp}");
    }

    // a Content-Length over the limit: 413 at once, the body never sent
    let t = std::time::Instant::now();
    let head = raw_answer(a, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{\"pro");
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
    // and the server still answers
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": "ROMEO.", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200);
}

/// The local addresses of the UDP sockets process `pid` holds (from `/proc`), as `/proc/net`
/// writes them (hex, IPv4 or IPv6).
fn udp_sockets_of(pid: u32) -> Vec<String> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|f| std::fs::read_link(f.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut out = Vec::new();
    for table in ["/proc/net/udp", "/proc/net/udp6"] {
        let Ok(t) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in t.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && inodes.iter().any(|i| i == f[9]) {
                out.push(f[1].to_string());
            }
        }
    }
    out
}

#[test]
fn the_demo_endpoint_stays_on_loopback_and_its_keys_go_with_a_sigterm() {
    use std::os::unix::fs::PermissionsExt;
    let (mut s, said) = Server::demo();
    let seen = said.join("\n");
    let dir = seen
        .split("certificates in ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("no key directory in: {seen}"));
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "{}", dir.display());
    // the coordinator's QUIC endpoint: 127.0.0.1 (or ::1), like its workers
    let udp = udp_sockets_of(s.child.id());
    assert!(!udp.is_empty(), "no UDP socket");
    for local in &udp {
        let ip = local.split(':').next().unwrap();
        assert!(
            ip == "0100007F" || ip == "00000000000000000000000001000000",
            "bound beyond loopback: {local}"
        );
    }
    // SIGTERM: the server ends and takes the cluster's keys with it
    // SAFETY: a plain kill(2) of our own child.
    assert_eq!(
        unsafe { libc::kill(s.child.id() as libc::pid_t, libc::SIGTERM) },
        0
    );
    let t = std::time::Instant::now();
    while s.child.try_wait().unwrap().is_none() {
        assert!(t.elapsed().as_secs() < 20, "the demo did not stop");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!dir.exists(), "{} is left", dir.display());
}

#[test]
fn completions_take_every_prompt_shape_each_prompt_its_own_sequence() {
    let s = Server::start(&["--parallel", "4"]);
    let a = s.addr.as_str();
    let tok = TextTokenizer::load(&demo()).unwrap();
    let texts = ["ROMEO. ", "JULIET. Good night", "MERCUTIO. A plague"];
    let ids: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t).unwrap()).collect();
    let one = |prompt: Value, extra: Value| {
        let mut b = json!({"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 7});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = post(a, "/v1/completions", &b);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        r.json()
    };
    // a list of strings: one choice per prompt, in order, each what the prompt alone gives;
    // the prompts run together as rows of one batch
    let list = one(json!(texts), json!({}));
    assert!(metric(a, "charm_batch_size_peak") >= 3.0);
    let singles: Vec<Value> = texts.iter().map(|t| one(json!(t), json!({}))).collect();
    let want: Vec<String> = singles.iter().flat_map(choice_texts).collect();
    assert_eq!(choice_texts(&list), want);
    for (i, c) in list["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    let sum = |k: &str| -> u64 {
        singles
            .iter()
            .map(|v| v["usage"][k].as_u64().unwrap())
            .sum()
    };
    assert_eq!(list["usage"]["prompt_tokens"], sum("prompt_tokens"));
    assert_eq!(list["usage"]["completion_tokens"], sum("completion_tokens"));
    assert_eq!(list["usage"]["total_tokens"], sum("total_tokens"));
    // a list of token-id lists (what lm-eval sends), and one list of ids, alike
    assert_eq!(choice_texts(&one(json!(ids), json!({}))), want);
    assert_eq!(choice_texts(&one(json!(ids[1]), json!({})))[0], want[1]);
    // n per prompt: choice p * n + j is prompt p with seed + j (vLLM's order)
    let two = one(json!(texts[..2]), json!({"n": 2}));
    let got = choice_texts(&two);
    assert_eq!(got.len(), 4);
    for p in 0..2 {
        for j in 0..2 {
            let alone = one(json!(texts[p]), json!({"seed": 7 + j}));
            assert_eq!(
                got[p * 2 + j],
                choice_texts(&alone)[0],
                "prompt {p}, choice {j}"
            );
            assert_eq!(two["choices"][p * 2 + j]["index"], p * 2 + j);
        }
    }
    // streamed: chunks carry their choice's index; the usage chunk sums the prompts
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 12, "temperature": 1.0, "seed": 7, "stream": true, "stream_options": {"include_usage": true}}),
    );
    let evs = events(&r.body);
    assert_eq!(evs.last().unwrap(), "[DONE]");
    let mut streamed = vec![String::new(); 3];
    let mut usage = Value::Null;
    for e in &evs[..evs.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            streamed[c["index"].as_u64().unwrap() as usize] += c["text"].as_str().unwrap();
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    assert_eq!(streamed, want);
    assert_eq!(usage["prompt_tokens"], sum("prompt_tokens"));
    assert_eq!(usage["completion_tokens"], sum("completion_tokens"));

    // echo + logprobs per prompt, with max_tokens 0 (the prompt scored) and 1 (lm-eval 0.4.13)
    for max_tokens in [0, 1] {
        let body = |prompt: Value| json!({"prompt": prompt, "max_tokens": max_tokens, "echo": true, "logprobs": 1, "temperature": 0});
        let list = post(a, "/v1/completions", &body(json!(ids))).json();
        let choices = list["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3, "{list}");
        for (p, c) in choices.iter().enumerate() {
            let alone = post(a, "/v1/completions", &body(json!(ids[p]))).json();
            assert_eq!(
                c["text"], alone["choices"][0]["text"],
                "max_tokens {max_tokens}"
            );
            assert_eq!(c["logprobs"], alone["choices"][0]["logprobs"]);
            assert!(c["text"].as_str().unwrap().starts_with(texts[p]));
            let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
            assert_eq!(lps.len(), ids[p].len() + max_tokens);
            assert!(lps[0].is_null() && lps[1..].iter().all(Value::is_f64));
        }
        assert_eq!(
            list["usage"]["completion_tokens"],
            3 * max_tokens,
            "{}",
            list["usage"]
        );
        let strings = post(a, "/v1/completions", &body(json!(texts))).json();
        assert_eq!(strings["choices"], list["choices"]);
    }

    // shapes that are none of these, and a bad prompt in a list, are a 400 naming it
    for (prompt, says) in [
        (json!([]), "empty"),
        (json!([1, "a"]), "must be a string"),
        (json!([[1, 2], [99999999]]), "`prompt`[1]"),
        (json!(["ROMEO.", ""]), "prompt 1"),
    ] {
        let r = post(
            a,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 2}),
        );
        assert_eq!(r.status, 400, "{prompt}");
        let m = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(m.contains(says), "{prompt}: {m}");
    }
}

#[test]
fn the_tokenizer_routes_answer_as_vllm_does_for_a_remote_tokenizer() {
    let s = Server::start(&[]);
    let a = s.addr.as_str();
    let tok = TextTokenizer::load(&demo()).unwrap();
    // what lm-evaluation-harness's RemoteTokenizer reads: /tokenizer_info with `eos_token`
    // (and `bos_token`, `pad_token`, `chat_template`), then /tokenize and /detokenize
    let info = http(a, "GET", "/tokenizer_info", &[], b"");
    assert_eq!(info.status, 200);
    let info = info.json();
    assert_eq!(info["eos_token"], "<|endoftext|>");
    assert_eq!(info["pad_token"], "<|endoftext|>");
    assert!(info["tokenizer_class"].is_string());
    assert!(info.get("vocab_file").is_none());
    let template = std::fs::read_to_string(demo().join("chat_template.jinja")).unwrap();
    assert_eq!(info["chat_template"], template);
    let tokenize = |body: Value| {
        let r = post(a, "/tokenize", &body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        r.json()
    };
    // lm-eval's probe, and its eos_token_id: the first id of the eos token's text
    let probe = tokenize(json!({"prompt": "test", "add_special_tokens": false}));
    assert!(probe["tokens"].is_array());
    let eos = tokenize(json!({"prompt": info["eos_token"], "add_special_tokens": false}));
    let stop = charm_shared::config::ModelSpec::from_dir(&demo())
        .unwrap()
        .eos_token_ids;
    assert_eq!(eos["tokens"], json!([stop[0]]));
    // a prompt: the ids /v1/completions reads, with their vocabulary strings when asked
    let text = "ROMEO. But soft, what light";
    let ids = tok.encode(text).unwrap();
    let t = tokenize(
        json!({"model": "charm-bard-moe", "prompt": text, "add_special_tokens": false, "return_token_strs": true}),
    );
    assert_eq!(t["tokens"], json!(ids));
    assert_eq!(t["count"], ids.len());
    assert_eq!(t["max_model_len"], 1024);
    let strs: Vec<String> = ids
        .iter()
        .map(|&i| tok.inner().id_to_token(i).unwrap())
        .collect();
    assert_eq!(t["token_strs"], json!(strs));
    // this tokenizer adds no special tokens to a prompt: vLLM's default changes nothing here
    assert_eq!(tokenize(json!({"prompt": text}))["tokens"], json!(ids));
    // messages: the conversation as /v1/chat/completions renders it
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak, Romeo."}]);
    let m = tokenize(json!({"messages": msgs}));
    let chat = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 1}),
    )
    .json();
    assert_eq!(m["count"], chat["usage"]["prompt_tokens"]);
    let open = tokenize(json!({"messages": msgs, "add_generation_prompt": false}));
    assert!(open["count"].as_u64() < m["count"].as_u64());
    // and back: vLLM's `prompt`, llama-server's `content`
    let d = post(a, "/detokenize", &json!({"tokens": ids})).json();
    assert_eq!(
        (d["prompt"].as_str(), d["content"].as_str()),
        (Some(text), Some(text))
    );
    // bad bodies: a 400 naming what is wrong
    for (body, says) in [
        (json!({"prompt": 3}), "`prompt`"),
        (json!({"prompt": "a", "messages": []}), "one of"),
        (
            json!({"prompt": "a", "add_special_tokens": "yes"}),
            "add_special_tokens",
        ),
        (
            json!({"messages": msgs, "continue_final_message": true}),
            "continue_final_message",
        ),
    ] {
        let r = post(a, "/tokenize", &body);
        assert_eq!(r.status, 400, "{body}");
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains(says), "{body}: {msg}");
    }
}

/// Whether `v` is an object with only the keys `keys` (some may be missing).
fn only_keys(v: &Value, keys: &[&str]) -> bool {
    v.as_object()
        .is_some_and(|o| o.keys().all(|k| keys.contains(&k.as_str())))
}

#[test]
fn schemas_that_leave_additional_properties_unset_get_closed_objects() {
    // no `additionalProperties` anywhere: the answer has the schema's keys and no others, at
    // every level
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}},
        "pets": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}}}},
        "required": ["name", "home"]});
    let check = |text: &str| {
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(only_keys(&v, &["name", "home", "pets"]), "{text}");
        assert!(only_keys(&v["home"], &["city"]), "{text}");
        for p in v["pets"].as_array().into_iter().flatten() {
            assert!(only_keys(p, &["kind"]), "{text}");
        }
        v
    };
    let s = Server::start(&[]);
    let a = s.addr.as_str();
    for seed in 0..4 {
        let t = if seed == 0 { 0.0 } else { 1.0 };
        // response_format's json_schema (chat), vLLM's guided_json and llama-server's
        // json_schema (completions)
        let r = post(a, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Who?"}],
            "max_tokens": 120, "temperature": t, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "who", "schema": schema}}}))
        .json();
        check(r["choices"][0]["message"]["content"].as_str().unwrap());
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        for field in ["guided_json", "json_schema"] {
            let (text, finish) = completion_text(
                a,
                &json!({"prompt": "ROMEO. ", "max_tokens": 120, "temperature": t, "seed": seed, field: schema}),
            );
            check(&text);
            assert_eq!(finish, "stop", "{field}: {text}");
        }
    }
    // a schema can still leave an object open: a key it requires beyond its properties is then
    // in the answer (a closed object could not hold it)
    let mut open = schema.clone();
    open["properties"]["home"]["additionalProperties"] = json!(true);
    open["properties"]["home"]["required"] = json!(["street"]);
    let (text, _) = completion_text(
        a,
        &json!({"prompt": "ROMEO. ", "max_tokens": 40, "temperature": 0, "guided_json": open}),
    );
    assert!(text.contains("\"street\": "), "{text}");
    drop(s);

    // tool parameters: a nested object of the arguments is closed too
    let tools = json!([{"type": "function", "function": {"name": "visit", "description": "Visit someone.",
        "parameters": {"type": "object", "properties": {
            "who": {"type": "string", "maxLength": 12},
            "where": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}}},
            "required": ["who", "where"]}}}]);
    let d = demo_with_real_template("Qwen-Qwen3-0.6B");
    let s = Server::start_model(&d, &[]);
    for seed in 0..3 {
        let r = post(&s.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Visit Juliet."}],
            "tools": tools, "tool_choice": {"type": "function", "function": {"name": "visit"}},
            "max_tokens": 120, "temperature": 1.0, "seed": seed, "chat_template_kwargs": {"enable_thinking": false}}))
        .json();
        let c = &r["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{r}");
        let args = c["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        let args: Value = serde_json::from_str(args).unwrap();
        assert!(only_keys(&args, &["who", "where"]), "{args}");
        assert!(only_keys(&args["where"], &["city"]), "{args}");
    }
    drop(s);
    std::fs::remove_dir_all(&d).unwrap();
}
