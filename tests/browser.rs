//! The chat page and the dashboard in a real browser: headless Chromium driven over WebDriver
//! (chromedriver) against `charm serve` processes on loopback.
//!
//! These tests need Debian's `chromium` and `chromium-driver` (`.ci/run` installs them). Where
//! either is missing each test prints a line saying so and passes without running. Screenshots
//! go to `target/browser/`.

mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cluster::{certs, workers_arg, Worker};
use common::http::{http, post};
use common::server::{demo, Server};
use serde_json::{json, Value};

/// The first of `names` found on `PATH`.
fn which(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    names.iter().find_map(|n| {
        std::env::split_paths(&path)
            .map(|d| d.join(n))
            .find(|p| p.is_file())
    })
}

/// A running chromedriver, killed when dropped.
struct Driver {
    child: Child,
    addr: String,
    browser: PathBuf,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    /// Starts chromedriver, or says why the test cannot run and returns `None`.
    fn start(test: &str) -> Option<Self> {
        let (Some(driver), Some(browser)) = (
            which(&["chromedriver"]),
            which(&["chromium", "chromium-browser", "google-chrome"]),
        ) else {
            // (`.ci/run` installs them and sets this: there a missing browser is a failure)
            assert!(
                std::env::var_os("CHARM_REQUIRE_BROWSER").is_none(),
                "{test}: CHARM_REQUIRE_BROWSER is set but chromium/chromedriver is not on PATH"
            );
            println!(
                "skipped {test}: no chromium/chromedriver on PATH (Debian: apt install chromium chromium-driver)"
            );
            return None;
        };
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let d = Self {
            child,
            addr: format!("127.0.0.1:{port}"),
            browser,
        };
        let t = Instant::now();
        while std::net::TcpStream::connect(&d.addr).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "chromedriver did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(d)
    }

    /// A headless browser session.
    fn session(&self) -> Session<'_> {
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": self.browser,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,900", "--no-first-run", "--disable-extensions"],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let v = call(&self.addr, "POST", "/session", &caps);
        Session {
            driver: self,
            id: v["sessionId"].as_str().expect("session id").to_string(),
        }
    }
}

/// One WebDriver command: its `value`, or a panic with the driver's error.
fn call(addr: &str, method: &str, path: &str, body: &Value) -> Value {
    let b = if method == "GET" {
        Vec::new()
    } else {
        body.to_string().into_bytes()
    };
    let r = http(
        addr,
        method,
        path,
        &[("Content-Type", "application/json")],
        &b,
    );
    let v = r.json();
    assert_eq!(r.status, 200, "WebDriver {method} {path}: {v}");
    v["value"].clone()
}

/// A browser session, ended when dropped.
struct Session<'d> {
    driver: &'d Driver,
    id: String,
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        let _ = http(
            &self.driver.addr,
            "DELETE",
            &format!("/session/{}", self.id),
            &[],
            b"",
        );
    }
}

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Session<'_> {
    fn cmd(&self, method: &str, path: &str, body: Value) -> Value {
        call(
            &self.driver.addr,
            method,
            &format!("/session/{}{path}", self.id),
            &body,
        )
    }

    fn go(&self, url: &str) {
        self.cmd("POST", "/url", json!({ "url": url }));
    }

    /// Opens the page of the server at `addr` and waits until it has talked to the API.
    fn open(&self, addr: &str) {
        self.go(&format!("http://{addr}/"));
        self.wait_ready();
    }

    /// Waits until the page has read the model's name from the API.
    fn wait_ready(&self) {
        self.wait_for(
            "the page to be ready",
            "return document.body.dataset.ready === 'true';",
            Duration::from_secs(20),
        );
    }

    fn find(&self, css: &str) -> String {
        let v = self.cmd(
            "POST",
            "/element",
            json!({"using": "css selector", "value": css}),
        );
        v[ELEMENT].as_str().expect("element id").to_string()
    }

    fn click(&self, css: &str) {
        let e = self.find(css);
        self.cmd("POST", &format!("/element/{e}/click"), json!({}));
    }

    /// Replaces the value of the input `css` by typing `text` (input events fire as for a user).
    fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css);
        self.cmd("POST", &format!("/element/{e}/clear"), json!({}));
        self.cmd(
            "POST",
            &format!("/element/{e}/value"),
            json!({ "text": text }),
        );
    }

    /// The rendered text of the element `css` (`innerText`, read in one step: the page redraws
    /// elements as events arrive).
    fn text(&self, css: &str) -> String {
        self.cmd(
            "POST",
            "/execute/sync",
            json!({"script": "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;",
                   "args": [css]}),
        )
        .as_str()
        .unwrap_or_else(|| panic!("no element {css}"))
        .to_string()
    }

    /// Runs `script` (a function body) in the page and returns what it returns.
    fn js(&self, script: &str) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            json!({"script": script, "args": []}),
        )
    }

    /// Waits until `script` returns something truthy, up to `limit`; returns it.
    fn wait_for(&self, what: &str, script: &str, limit: Duration) -> Value {
        let t = Instant::now();
        loop {
            let v = self.js(script);
            if !(v.is_null() || v == json!(false) || v == json!("") || v == json!(0)) {
                return v;
            }
            assert!(
                t.elapsed() < limit,
                "waited {limit:?} for {what}; the page says: {}",
                self.js("return document.body.innerText.slice(0, 2000);")
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// The browser console's messages at level SEVERE since the last call.
    fn console_errors(&self) -> Vec<String> {
        self.cmd("POST", "/se/log", json!({"type": "browser"}))
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e["level"] == "SEVERE")
            .map(|e| e["message"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// Saves a screenshot to `target/browser/NAME.png`.
    fn screenshot(&self, name: &str) -> PathBuf {
        let b64 = self.cmd("GET", "/screenshot", json!({}));
        let png = base64(b64.as_str().expect("screenshot"));
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/browser");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("{name}.png"));
        std::fs::write(&p, png).unwrap();
        p
    }
}

fn base64(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a' + 26) as u32,
            b'0'..=b'9' => (c - b'0' + 52) as u32,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let clean: Vec<u8> = s
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for chunk in clean.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= val(c) << (18 - 6 * i);
        }
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

/// Sets the chat's sampling settings through the settings form.
fn set_sampling(s: &Session, temperature: &str, max_tokens: &str) {
    s.click("#settings > summary");
    s.type_into("#set-temperature", temperature);
    s.type_into("#set-max-tokens", max_tokens);
}

/// Types `text` into the composer and sends it; waits until the answer is in (or stopped) and
/// returns the assistant message's raw content as the page keeps it.
fn ask(s: &Session, text: &str) -> String {
    s.type_into("#prompt", text);
    s.click("#send");
    s.wait_for(
        "the answer",
        "const m = [...document.querySelectorAll('.msg.assistant')].pop(); \
         return m && m.dataset.state !== 'streaming' && m.dataset.state;",
        Duration::from_secs(60),
    );
    last_answer(s)
}

fn last_answer(s: &Session) -> String {
    s.js(
        "const c = JSON.parse(localStorage.getItem('charm.conversations')) \
            .find(x => x.id === JSON.parse(localStorage.getItem('charm.current'))); \
          return c.messages[c.messages.length - 1].content;",
    )
    .as_str()
    .unwrap()
    .to_string()
}

/// The greedy answer to `prompt` over the API.
fn api_answer(addr: &str, key: Option<&str>, prompt: &str, max_tokens: u32) -> String {
    let auth = key.map(|k| format!("Bearer {k}"));
    let mut h = vec![("Content-Type", "application/json")];
    if let Some(a) = &auth {
        h.push(("Authorization", a));
    }
    let body = json!({"messages": [{"role": "user", "content": prompt}],
                      "max_tokens": max_tokens, "temperature": 0});
    let r = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &h,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200);
    r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn the_chat_page_streams_the_apis_answer_and_shows_markup_as_text() {
    let Some(d) = Driver::start("the_chat_page_streams_the_apis_answer_and_shows_markup_as_text")
    else {
        return;
    };
    let (srv, _) = Server::demo();
    let s = d.session();
    s.open(&srv.addr);
    assert_eq!(s.text("#model-name"), "charm-bard-moe");
    set_sampling(&s, "0", "24");
    let prompt = "Speak, Romeo.";
    let page = ask(&s, prompt);
    let api = api_answer(&srv.addr, None, prompt, 24);
    assert!(!api.is_empty());
    assert_eq!(
        page, api,
        "the page's streamed answer is the API's greedy one"
    );
    let shown = s.text(".msg.assistant .content");
    let squash = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(squash(&shown), squash(&api), "the answer as shown");
    let stats = s.text(".msg.assistant .stats");
    assert!(
        stats.contains("24 tokens") && stats.contains("tok/s") && stats.contains("first token"),
        "{stats}"
    );

    // a model answer with markup (the grammar makes the model write it): shown as text
    let hostile = "<script>window.pwned=1</script><img src=x onerror=\"window.pwned=2\"> [x](javascript:alert(1)) **ok**";
    let regex: String = hostile
        .chars()
        .map(|c| {
            if !r"\.+*?()|[]{}^$/".contains(c) {
                c.to_string()
            } else {
                format!("\\{c}")
            }
        })
        .collect();
    s.type_into("#set-extra", &json!({ "guided_regex": regex }).to_string());
    s.type_into("#set-max-tokens", "200");
    let page = ask(&s, "Say something.");
    assert_eq!(
        page,
        hostile,
        "the model wrote the markup; the page shows {}",
        s.text("#messages .msg.assistant:last-child")
    );
    let shown = s.text("#messages .msg.assistant:last-child .content");
    assert!(
        shown.contains("<script>window.pwned=1</script><img src=x"),
        "{shown}"
    );
    assert!(shown.contains("[x](javascript:alert(1)) ok"), "{shown}");
    let injected = s.js(
        "return [document.querySelectorAll('#messages script, #messages img').length, \
                   typeof window.pwned, \
                   document.querySelectorAll('#messages a').length, \
                   document.querySelectorAll('#messages strong').length];",
    );
    assert_eq!(
        injected,
        json!([0, "undefined", 0, 1]),
        "no element came from the model's text but the bold"
    );
    // reasoning in a `<think>` block is folded apart from the answer
    s.js("const c = JSON.parse(localStorage.getItem('charm.conversations')); \
          c[0].messages.push({role: 'user', content: 'Think first.'}, \
                             {role: 'assistant', content: '<think>weighing it</think>The answer.', state: 'done'}); \
          localStorage.setItem('charm.conversations', JSON.stringify(c));");
    s.open(&srv.addr);
    assert_eq!(
        s.js(
            "const m = [...document.querySelectorAll('.msg.assistant')].pop(); \
              const d = m.querySelector('details.reasoning'); \
              return [d !== null && !d.open, d && d.querySelector('div').textContent, \
                      m.querySelector('.content').textContent];"
        ),
        json!([true, "weighing it", "The answer."])
    );
    // the conversation is kept in the browser: a reload shows it again
    s.go(&format!("http://{}/", srv.addr));
    s.wait_for(
        "the kept conversation",
        "return document.querySelectorAll('.msg').length === 6;",
        Duration::from_secs(20),
    );
    let errors = s.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    let p = s.screenshot("chat");
    println!("chat page screenshot: {}", p.display());
    // the demo's dashboard: its two loopback workers, up
    s.click("#tab-dashboard");
    for w in ["w1", "w2"] {
        s.wait_for(
            &format!("{w} up"),
            &format!("const r = document.querySelector('#d-workers tr[data-worker=\"{w}\"]'); return r && r.dataset.up === 'true';"),
            Duration::from_secs(20),
        );
    }
    let errors = s.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");
}

#[test]
fn three_turns_with_the_pages_defaults_fit_the_context_and_the_dashboard_is_right_when_idle() {
    let Some(d) = Driver::start(
        "three_turns_with_the_pages_defaults_fit_the_context_and_the_dashboard_is_right_when_idle",
    ) else {
        return;
    };
    let (srv, _) = Server::demo();
    let s = d.session();
    s.open(&srv.addr);
    // the defaults (temperature 0.7, max tokens 512) against the demo's 1,024-token context:
    // every turn is answered; a turn that would not leave room for an answer leaves the oldest
    // turns out of the request and says so
    for (i, prompt) in ["Speak, Romeo.", "What say you, Juliet?", "And then?"]
        .iter()
        .enumerate()
    {
        ask(&s, prompt);
        let state =
            s.js("return [...document.querySelectorAll('.msg.assistant')].pop().dataset.state;");
        assert_eq!(
            state,
            "done",
            "turn {}: {}",
            i + 1,
            s.text("#messages .msg.assistant:last-child .stats")
        );
    }
    let kept = s.js(
        "const c = JSON.parse(localStorage.getItem('charm.conversations'))[0]; \
         return c.messages.length;",
    );
    assert_eq!(
        kept, 6,
        "the page keeps every message, even those left out of a request"
    );
    // the sidebar: "New chat" twice leaves one empty conversation beside the one with messages
    s.click("#new-chat");
    s.click("#new-chat");
    assert_eq!(
        s.js("return document.querySelectorAll('#conversations li').length;"),
        2
    );
    // the dashboard with nothing running: no batch, and each worker's RAM for its experts
    s.click("#tab-dashboard");
    s.wait_for(
        "an idle batch",
        "const dt = [...document.querySelectorAll('#d-server dt')].find(x => x.textContent === 'batch'); \
         return dt && dt.nextElementSibling.textContent.startsWith('0 of');",
        Duration::from_secs(20),
    );
    for w in ["w1", "w2"] {
        let ram = s.wait_for(
            &format!("{w}'s row"),
            &format!("const r = document.querySelector('#d-workers tr[data-worker=\"{w}\"]'); return r && r.lastElementChild.textContent;"),
            Duration::from_secs(20),
        );
        let ram = ram.as_str().unwrap_or_default().to_string();
        assert!(ram.contains("B"), "{w}'s RAM shows {ram:?}");
    }
    let errors = s.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");
}

#[test]
fn with_an_api_key_the_page_asks_for_it_and_refuses_without_it() {
    let Some(d) = Driver::start("with_an_api_key_the_page_asks_for_it_and_refuses_without_it")
    else {
        return;
    };
    let dir = common::scratch("browser-key");
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("key");
    std::fs::write(&key_file, "s3cret-key-of-the-page\n").unwrap();
    let srv = Server::start(&["--api-key-file", key_file.to_str().unwrap()]);
    // the page itself is served; nothing else is without the key (`/health` says only that the
    // server is up)
    assert_eq!(http(&srv.addr, "GET", "/", &[], b"").status, 200);
    assert_eq!(
        http(&srv.addr, "GET", "/health", &[], b"").json(),
        json!({"status": "ok", "ready": true})
    );
    assert_eq!(http(&srv.addr, "GET", "/page/app.js", &[], b"").status, 200);
    for path in ["/v1/status", "/v1/status/events", "/v1/models", "/metrics"] {
        assert_eq!(http(&srv.addr, "GET", path, &[], b"").status, 401, "{path}");
    }
    let r = post(
        &srv.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 401);

    let s = d.session();
    s.go(&format!("http://{}/", srv.addr));
    s.wait_for(
        "the key dialog",
        "return document.getElementById('key-dialog').open;",
        Duration::from_secs(20),
    );
    assert_ne!(s.js("return document.body.dataset.ready;"), json!("true"));
    // a wrong key is refused and asked for again
    s.type_into("#key-input", "wrong");
    s.click("#key-submit");
    s.wait_for(
        "the refusal",
        "return document.getElementById('key-dialog').open && !document.getElementById('key-error').hidden;",
        Duration::from_secs(20),
    );
    s.type_into("#key-input", "s3cret-key-of-the-page");
    s.click("#key-submit");
    s.wait_ready();
    set_sampling(&s, "0", "12");
    let page = ask(&s, "Speak, Romeo.");
    assert_eq!(
        page,
        api_answer(
            &srv.addr,
            Some("s3cret-key-of-the-page"),
            "Speak, Romeo.",
            12
        )
    );
    // the dashboard's status stream works with the key too
    s.go(&format!("http://{}/#dashboard", srv.addr));
    s.wait_for(
        "a status",
        "return document.body.dataset.statusMode === 'events' && document.body.dataset.statusAt;",
        Duration::from_secs(20),
    );
    // where the event stream cannot be opened (blocked here through the DevTools protocol) the
    // dashboard polls /v1/status instead
    s.cmd(
        "POST",
        "/goog/cdp/execute",
        json!({"cmd": "Network.enable", "params": {}}),
    );
    s.cmd(
        "POST",
        "/goog/cdp/execute",
        json!({"cmd": "Network.setBlockedURLs", "params": {"urls": ["*/v1/status/events*"]}}),
    );
    s.go("about:blank");
    s.go(&format!("http://{}/#dashboard", srv.addr));
    s.wait_for(
        "a polled status",
        "return document.body.dataset.statusMode === 'polling' && document.body.dataset.statusAt;",
        Duration::from_secs(20),
    );
    // the 401s the wrong key drew and the blocked stream are the only console errors
    let errors: Vec<String> = s
        .console_errors()
        .into_iter()
        .filter(|e| !e.contains("401") && !e.contains("ERR_BLOCKED_BY_CLIENT"))
        .collect();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    drop(srv);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `/metrics` counter `name`.
fn metric(addr: &str, name: &str) -> f64 {
    let r = http(addr, "GET", "/metrics", &[], b"");
    String::from_utf8_lossy(&r.body)
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[test]
fn the_dashboard_follows_workers_down_and_up_and_stop_cancels_on_the_server() {
    let Some(d) =
        Driver::start("the_dashboard_follows_workers_down_and_up_and_stop_cancels_on_the_server")
    else {
        return;
    };
    let dir = certs("browser-cluster");
    // heartbeats every second, answered within one: a lost worker is seen within two
    let heartbeat_ms = 1000;
    let cfg = json!({"workers": [], "heartbeat_ms": heartbeat_ms, "deadline_ms": heartbeat_ms});
    std::fs::write(dir.join("cluster.json"), cfg.to_string()).unwrap();
    let model = demo();
    let w1 = Worker::start(&model, &dir, "w1", 0, &[]);
    let mut w2 = Worker::start(&model, &dir, "w2", 0, &[]);
    let list = workers_arg(&[(&w1, "w1"), (&w2, "w2")]);
    let srv = Server::start(&["--cluster", dir.to_str().unwrap(), "--workers", &list]);

    let s = d.session();
    s.open(&srv.addr);
    // a long answer, stopped once it streams: the server cancels it
    set_sampling(&s, "0", "1000");
    s.type_into("#prompt", "Speak, Romeo.");
    s.click("#send");
    s.wait_for(
        "the first words",
        "const m = document.querySelector('.msg.assistant .content'); return m && m.textContent.length > 0;",
        Duration::from_secs(60),
    );
    s.click("#stop");
    s.wait_for(
        "the stop",
        "const m = document.querySelector('.msg.assistant'); return m.dataset.state === 'stopped';",
        Duration::from_secs(20),
    );
    let t = Instant::now();
    while metric(&srv.addr, "charm_requests_cancelled_total") < 1.0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the server did not cancel the stopped generation"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let kept = last_answer(&s);
    assert!(!kept.is_empty());
    let full = api_answer(&srv.addr, None, "Speak, Romeo.", 1000);
    assert!(
        full.starts_with(&kept) && full.len() > kept.len(),
        "the stopped answer is a prefix of the whole one"
    );

    // the dashboard: both workers up, every MoE layer's heat row drawn
    s.go(&format!("http://{}/#dashboard", srv.addr));
    let up = |name: &str, state: &str| {
        format!(
            "const r = document.querySelector('#d-workers tr[data-worker=\"{name}\"]'); return r && r.dataset.up === '{state}';"
        )
    };
    for w in ["w1", "w2"] {
        s.wait_for(&format!("{w} up"), &up(w, "true"), Duration::from_secs(20));
    }
    let heat = s.wait_for(
        "the heat map",
        "return document.getElementById('d-heat').dataset.cell;",
        Duration::from_secs(20),
    );
    assert!(heat.as_str().is_some_and(|c| c.contains('x')));
    let status = http(&srv.addr, "GET", "/v1/status", &[], b"").json();
    let legend = s.text("#d-legend");
    for w in ["w1", "w2"] {
        assert!(legend.contains(w), "{legend}");
    }
    let layers = status["heat"]["layers"].as_array().unwrap();
    let main: Vec<&Value> = layers.iter().filter(|l| l["mtp"] == false).collect();
    assert_eq!(main.len(), 3);
    assert!(main.iter().all(|l| l["uses"]
        .as_array()
        .unwrap()
        .iter()
        .any(|u| u.as_u64() > Some(0))));
    let p = s.screenshot("dashboard");
    println!("dashboard screenshot: {}", p.display());

    // w2 killed: shown down within two heartbeats (and the page's next status push)
    w2.child.kill().unwrap();
    w2.child.wait().unwrap();
    let killed = Instant::now();
    s.wait_for("w2 down", &up("w2", "false"), Duration::from_secs(30));
    let seen = killed.elapsed();
    println!("w2 shown down {seen:?} after it was killed");
    assert!(
        seen <= Duration::from_millis(2 * heartbeat_ms + 1000 + 1000),
        "shown down after {seen:?}: two heartbeats are {}ms, the page's push a second",
        2 * heartbeat_ms
    );
    assert_eq!(s.js(&up("w1", "true")), json!(true));
    let port = w2.port;
    drop(w2);
    let _w2 = Worker::start(&model, &dir, "w2", port, &[]);
    s.wait_for("w2 up again", &up("w2", "true"), Duration::from_secs(30));
    let errors = s.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    drop(w1);
    drop(_w2);
    drop(srv);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_status_document_describes_a_single_box_server() {
    // no browser needed: the JSON scripts read
    let srv = Server::start(&[]);
    let r = post(
        &srv.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 8}),
    );
    assert_eq!(r.status, 200);
    let d = http(&srv.addr, "GET", "/v1/status", &[], b"").json();
    assert_eq!(d["model"]["name"], "charm-bard-moe");
    // layer 0 is dense; the MTP head's layer routes too
    assert_eq!(d["model"]["moe_layers"], 3);
    assert_eq!(d["model"]["mtp_layers"], 1);
    assert_eq!(d["server"]["requests"], 1);
    assert_eq!(d["server"]["generated_tokens"], 8);
    assert_eq!(d["workers"], json!([]));
    assert_eq!(d["cluster"], Value::Null);
    assert_eq!(d["heat"]["locations"], json!(["coordinator RAM"]));
    let layers = d["heat"]["layers"].as_array().unwrap();
    // every token of the prompt and the answer routed top_k experts in each MoE layer
    let k = d["model"]["experts_per_token"].as_u64().unwrap();
    let prompt = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(layers.len(), 4, "three MoE layers and the MTP head's");
    for l in layers.iter().filter(|l| l["mtp"] == false) {
        let picks: u64 = l["uses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u.as_u64().unwrap())
            .sum();
        // the last token sampled is not fed back
        assert_eq!(picks, (prompt + 8 - 1) * k, "layer {}", l["layer"]);
        assert!(l["where"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w == &json!([0])));
    }
    // every expert is in RAM: each pick the heat map counts (the MTP head's too) was a hit
    let all_picks: u64 = layers
        .iter()
        .flat_map(|l| l["uses"].as_array().unwrap())
        .map(|u| u.as_u64().unwrap())
        .sum();
    assert_eq!(d["experts"]["hits"], all_picks);
    assert_eq!(d["experts"]["uses"], all_picks);
    assert!(http(&srv.addr, "GET", "/v1/status?heat=false", &[], b"")
        .json()
        .get("heat")
        .is_none());
    // the event stream: a status document at once
    let mut sock = std::net::TcpStream::connect(&srv.addr).unwrap();
    use std::io::Write;
    sock.write_all(
        format!(
            "GET /v1/status/events?heat=false HTTP/1.1\r\nHost: {}\r\n\r\n",
            srv.addr
        )
        .as_bytes(),
    )
    .unwrap();
    let mut lines = BufReader::new(sock).lines();
    let first = lines
        .by_ref()
        .map(|l| l.unwrap())
        .find(|l| l.starts_with("data: "))
        .unwrap();
    let doc: Value = serde_json::from_str(&first["data: ".len()..]).unwrap();
    assert_eq!(doc["server"]["generated_tokens"], 8);
    // the page and its files, with a policy that allows no inline or foreign script
    let page = http(&srv.addr, "GET", "/", &[], b"");
    assert_eq!(page.status, 200);
    assert!(page
        .header("content-security-policy")
        .is_some_and(|p| p.contains("script-src 'self'")));
    assert_eq!(
        http(&srv.addr, "GET", "/page/nope.js", &[], b"").status,
        404
    );
}
