//! The cluster on loopback: decode speed with worker processes next to one process at equal
//! residency, each worker's round trip per layer next to a bare QUIC echo of the same sizes, the
//! wire bytes per token against their floor, and the same behind a UDP relay that delays every
//! datagram (added round trip `--delays` ms), where the network time a token adds is compared
//! with its floor, MoE layers x round trip.
//!
//! ```sh
//! cargo bench --bench cluster -- --model DIR [--workers 2] [--tokens 32] [--delays 0,0.2,1]
//!                                [--activations f32|int8] [--draft N] [--temperature T] [--pin]
//!                                [--predict] [--spin-us N] [--dense-device cpu|gpu]
//! ```
//!
//! `--predict` checks `charm plan --cluster`'s prediction: before each delay's decode it probes
//! the workers through the same client (this process's dense pass, each worker's requests) and
//! predicts decode tok/s, then prints predicted against measured. `--dense-device gpu` runs the
//! coordinator's dense pass on the GPU (and single-box too), which the probe then times there.
//!
//! `--pin` (one worker, two or more cores) measures the request overhead without two processes
//! fighting for cores: this process (the coordinator, one compute thread) is pinned to core 0,
//! the worker (`--threads 1`) to core 1 (`taskset`), and each layer request's round trip is set
//! beside a raw UDP echo of the same sizes between the same two cores. A request's rest (its
//! round trip less the worker's compute) is printed as the run's mean and as the median of the
//! requests' own (the echoes are medians of their exchanges), and that median per MoE layer:
//! the first after the dense pass (output layer, dense layers, megabytes of weights through the
//! coordinator's core) pays for the network path's code and data read back into its caches.
//!
//! `--spin-us N` sets how long the workers keep their core awake after an answer and the
//! coordinator polls for answers before sleeping (`charm worker --spin-us`, the cluster file's
//! `spin_us`). Without it: pinned, each side's default (each process has a core of its own, as
//! on separate machines); unpinned, none (the processes share the cores, as `charm demo`'s
//! loopback workers do). The echoes' threads block, as plain sockets do; the QUIC echo's
//! asking side runs on a single-threaded runtime driven by the thread that waits, as the
//! coordinator's client does, and its echoing side on a runtime of a worker's threads. Where
//! both sides of the cluster poll (pinned, by default), the QUIC echo is timed a second time
//! with both of its sides polling too: QUIC's own cost under the cluster's waiting scheme, which
//! a request's rest cannot go below.
//!
//! Tokens are sampled (temperature 1, seed 1; `--temperature` to change) so that random synthetic
//! weights do not repeat one token; every run decodes the same tokens (checked). With `--draft N`
//! each delay is also run with speculative decoding (adaptive, at most N drafts): its speed next
//! to the plain run's, tokens per step and acceptance.

use std::collections::VecDeque;
use std::net::{SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::median;

use charm_coordinator::cluster::probe;
use charm_coordinator::cluster::remote::moe_layers;
use charm_coordinator::cluster::{Loopback, WorkerAddr};
use charm_coordinator::decode::generate::generate_with_drafts;
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::decode::speculative::{DraftOptions, SpecStats};
use charm_coordinator::model::engine::DenseDevice;
use charm_coordinator::{Engine, EngineOptions, ForwardOptions, HistoryPolicy};
use charm_shared::quant::Activations;

struct Args {
    pin: bool,
    predict: bool,
    model: PathBuf,
    workers: usize,
    tokens: usize,
    delays: Vec<f64>,
    act: String,
    draft: usize,
    temperature: f32,
    spin_us: Option<u64>,
    /// The coordinator's dense pass on the GPU (`--dense-device gpu`), in the decode and in the
    /// probe.
    dense_gpu: bool,
}

fn args() -> Args {
    let mut a = Args {
        pin: false,
        predict: false,
        model: PathBuf::new(),
        workers: 2,
        tokens: 32,
        delays: vec![0.0, 0.2, 1.0],
        act: "f32".into(),
        draft: 0,
        temperature: 1.0,
        spin_us: None,
        dense_gpu: false,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let val = || v.get(i + 1).cloned().expect("flag without a value");
        match v[i].as_str() {
            "--pin" => {
                a.pin = true;
                i += 1;
                continue;
            }
            "--predict" => {
                a.predict = true;
                i += 1;
                continue;
            }
            "--model" => a.model = val().into(),
            "--workers" => a.workers = val().parse().expect("--workers N"),
            "--tokens" => a.tokens = val().parse().expect("--tokens N"),
            "--delays" => {
                a.delays = val()
                    .split(',')
                    .map(|d| d.parse().expect("--delays MS,MS"))
                    .collect()
            }
            "--activations" => a.act = val(),
            "--draft" => a.draft = val().parse().expect("--draft N"),
            "--temperature" => a.temperature = val().parse().expect("--temperature T"),
            "--spin-us" => a.spin_us = Some(val().parse().expect("--spin-us N")),
            "--dense-device" => {
                a.dense_gpu = match val().as_str() {
                    "gpu" => true,
                    "cpu" => false,
                    d => panic!("--dense-device cpu|gpu, not {d}"),
                }
            }
            // cargo bench passes --bench
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    assert!(
        !a.model.as_os_str().is_empty(),
        "usage: cargo bench --bench cluster -- --model DIR [--workers N] [--tokens N] [--delays MS,..]"
    );
    a
}

/// A UDP relay adding `delay` to every datagram each way (half the added round trip), between
/// one client and `upstream`.
struct Relay {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

type Queue = Arc<(Mutex<VecDeque<(Instant, Vec<u8>)>>, Condvar)>;
type Send = Box<dyn Fn(&[u8]) + std::marker::Send>;

impl Relay {
    fn start(upstream: SocketAddr, delay: Duration) -> Self {
        let front = UdpSocket::bind("127.0.0.1:0").unwrap();
        let back = UdpSocket::bind("127.0.0.1:0").unwrap();
        back.connect(upstream).unwrap();
        for s in [&front, &back] {
            s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        }
        let addr = front.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let client: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
        let (up, down): (Queue, Queue) = (Arc::default(), Arc::default());
        let (front, back) = (Arc::new(front), Arc::new(back));
        // receivers stamp each datagram with the time it may leave
        {
            let (f, q, c, st) = (front.clone(), up.clone(), client.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !st.load(Ordering::Relaxed) {
                    if let Ok((n, from)) = f.recv_from(&mut buf) {
                        *c.lock().unwrap() = Some(from);
                        q.0.lock()
                            .unwrap()
                            .push_back((Instant::now() + delay, buf[..n].to_vec()));
                        q.1.notify_one();
                    }
                }
            });
        }
        {
            let (b, q, st) = (back.clone(), down.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !st.load(Ordering::Relaxed) {
                    if let Ok(n) = b.recv(&mut buf) {
                        q.0.lock()
                            .unwrap()
                            .push_back((Instant::now() + delay, buf[..n].to_vec()));
                        q.1.notify_one();
                    }
                }
            });
        }
        // senders release them in order once due
        let sender = |q: Queue, send: Send, st: Arc<AtomicBool>| {
            std::thread::spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    let next = {
                        let mut g = q.0.lock().unwrap();
                        while g.is_empty() && !st.load(Ordering::Relaxed) {
                            g = q.1.wait_timeout(g, Duration::from_millis(50)).unwrap().0;
                        }
                        g.pop_front()
                    };
                    let Some((due, d)) = next else { continue };
                    // sleep most of the wait, spin the last stretch (timer slack is ~50 us)
                    loop {
                        let now = Instant::now();
                        if now >= due {
                            break;
                        }
                        let left = due - now;
                        if left > Duration::from_micros(120) {
                            std::thread::sleep(left - Duration::from_micros(100));
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                    send(&d);
                }
            });
        };
        let b2 = back.clone();
        sender(up, Box::new(move |d| drop(b2.send(d))), stop.clone());
        let f2 = front.clone();
        sender(
            down,
            Box::new(move |d| {
                if let Some(c) = *client.lock().unwrap() {
                    let _ = f2.send_to(d, c);
                }
            }),
            stop.clone(),
        );
        Self { addr, stop }
    }
}

/// Median round trip of a bare QUIC exchange on a stream kept open (as a worker's compute
/// requests go on one, [`charm_coordinator::cluster`]): `up` bytes out, `down` back,
/// with the cluster's TLS identities and transport settings, to `server` or via `via`. With
/// `polled` (a worker's spin), neither side's thread sleeps between exchanges: the echoing side
/// polls after each answer as a worker does ([`charm_worker::server::Warm`]), and the asking
/// side while it waits, as the coordinator's forward thread does for a layer's answers.
fn quic_echo(
    dir: &std::path::Path,
    up: usize,
    down: usize,
    delay: Option<Duration>,
    echo_cpu: Option<usize>,
    echo_threads: usize,
    polled: Option<Duration>,
) -> f64 {
    use charm_worker::tls::Identity;
    // the echoing side on a runtime of its own (on `echo_cpu` when given) with as many threads
    // as a worker given `--threads`; the asking side on a single-threaded runtime driven by the
    // thread that waits, as the coordinator's is
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let server_dir = dir.to_path_buf();
    let echo = std::thread::spawn(move || {
        if let Some(c) = echo_cpu {
            pin_to(c);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(echo_threads)
            .enable_all()
            .build()
            .unwrap();
        let warm = polled.and_then(charm_worker::server::Warm::new);
        let poller = warm.clone().map(|w| rt.spawn(w.poll()));
        rt.block_on(async move {
            let server_id = Identity::load(&server_dir, "w1").unwrap();
            let ep =
                charm_worker::server::listen("127.0.0.1:0".parse().unwrap(), &server_id).unwrap();
            // (the endpoint goes along, so the caller can close it and end this thread)
            addr_tx
                .send((ep.local_addr().unwrap(), ep.clone()))
                .unwrap();
            while let Some(inc) = ep.accept().await {
                let warm = warm.clone();
                tokio::spawn(async move {
                    let Ok(c) = inc.await else { return };
                    while let Ok((mut s, mut r)) = c.accept_bi().await {
                        let warm = warm.clone();
                        tokio::spawn(async move {
                            let (mut ask, answer) = (vec![0u8; up], vec![7u8; down]);
                            while r.read_exact(&mut ask).await.is_ok() {
                                if s.write_all(&answer).await.is_err() {
                                    break;
                                }
                                if let Some(w) = &warm {
                                    w.answered();
                                }
                            }
                        });
                    }
                });
            }
        });
        if let Some(p) = poller {
            p.abort();
        }
    });
    let (addr, server) = addr_rx.recv().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let median = rt.block_on(async {
        let relay = delay.map(|d| Relay::start(addr, d / 2));
        let target = relay.as_ref().map_or(addr, |r| r.addr);
        let id = Identity::load(dir, "coordinator").unwrap();
        let mut cfg = id.client_config().unwrap();
        cfg.transport_config(Arc::new(charm_worker::server::transport(
            Duration::from_secs(1),
        )));
        let mut cl = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        cl.set_default_client_config(cfg);
        let c = cl.connect(target, "w1").unwrap().await.unwrap();
        let payload = vec![1u8; up];
        let poller = polled.map(|_| tokio::spawn(keep_polling()));
        let mut times = Vec::new();
        let (mut s, mut r) = c.open_bi().await.unwrap();
        let mut got = vec![0u8; down];
        for i in 0..220 {
            let t = Instant::now();
            s.write_all(&payload).await.unwrap();
            r.read_exact(&mut got).await.unwrap();
            if i >= 20 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        if let Some(p) = poller {
            p.abort();
        }
        drop(relay);
        median(times)
    });
    server.close(0u32.into(), b"");
    echo.join().unwrap();
    median
}

/// Yields to its runtime in a loop, so that the runtime's thread polls its sockets instead of
/// sleeping in them (as the coordinator's forward thread does while it waits for answers).
async fn keep_polling() {
    loop {
        tokio::task::yield_now().await;
    }
}

/// Pins the calling thread (and the threads it starts later) to `cpu`.
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0,
            "pinning to core {cpu}"
        );
    }
}

/// Asks for a receive buffer that holds `bytes` of datagrams (past the `rmem_max` cap where the
/// process may, as root can), so that one exchange's burst is not dropped on arrival.
fn receive_buffer(sock: &UdpSocket, bytes: usize) {
    use std::os::fd::AsRawFd;
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: `v` is a c_int that outlives the call, and its size is passed with it.
        let r = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &v as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            return;
        }
    }
}

/// Median round trip of a raw UDP exchange between two threads: `up` bytes out in datagrams of
/// 1,200 bytes (QUIC's own size), `down` bytes back the same way; the echoing thread pinned to
/// `echo_cpu` when given. Each datagram carries its exchange's number, so a lost one (the
/// exchange is then not counted) cannot shift the ones after it; both sockets' receive buffers
/// hold a whole exchange (GLM-5.2-sized answers are hundreds of datagrams).
fn udp_echo(up: usize, down: usize, echo_cpu: Option<usize>) -> f64 {
    const DGRAM: usize = 1200;
    let sizes = |total: usize| -> Vec<usize> {
        let n = total.max(8).div_ceil(DGRAM);
        (0..n)
            .map(|i| (total.max(8) - i * DGRAM).clamp(8, DGRAM))
            .collect()
    };
    let (up_sizes, down_sizes) = (sizes(up), sizes(down));
    let server = UdpSocket::bind("127.0.0.1:0").unwrap();
    // a datagram's buffer costs the kernel more than its bytes: room for four exchanges
    receive_buffer(&server, 4 * (up + down + 64 * 1024));
    let addr = server.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    server
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let expect = up_sizes.len();
    let replies = down_sizes.clone();
    let echo = std::thread::spawn(move || {
        if let Some(c) = echo_cpu {
            pin_to(c);
        }
        let mut buf = vec![0u8; 65536];
        let mut reply = vec![7u8; DGRAM];
        let (mut seq, mut got) = (u64::MAX, 0);
        while !st.load(Ordering::Relaxed) {
            let Ok((n, from)) = server.recv_from(&mut buf) else {
                continue;
            };
            if n < 8 {
                continue;
            }
            let s = u64::from_le_bytes(buf[..8].try_into().unwrap());
            if s != seq {
                (seq, got) = (s, 0);
            }
            got += 1;
            if got == expect {
                reply[..8].copy_from_slice(&s.to_le_bytes());
                for &m in &replies {
                    let _ = server.send_to(&reply[..m], from);
                }
            }
        }
    });
    let client = UdpSocket::bind("127.0.0.1:0").unwrap();
    receive_buffer(&client, 4 * (up + down + 64 * 1024));
    client.connect(addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut payload = vec![1u8; DGRAM];
    let mut buf = vec![0u8; 65536];
    let mut times = Vec::new();
    let mut lost = 0;
    for seq in 0u64.. {
        if times.len() >= 400 || lost >= 50 {
            break;
        }
        payload[..8].copy_from_slice(&seq.to_le_bytes());
        let t = Instant::now();
        for &m in &up_sizes {
            client.send(&payload[..m]).unwrap();
        }
        let mut got = 0;
        while got < down_sizes.len() {
            match client.recv(&mut buf) {
                Ok(n) if n >= 8 && buf[..8] == seq.to_le_bytes() => got += 1,
                Ok(_) => {} // a late answer to an exchange given up on
                Err(_) => break,
            }
        }
        if got < down_sizes.len() {
            lost += 1;
            continue;
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    stop.store(true, Ordering::Relaxed);
    echo.join().unwrap();
    if times.len() <= 40 {
        // (datagrams dropped by a busy machine: no figure rather than a wrong one)
        eprintln!("the raw UDP echo lost {lost} exchanges: no figure");
        return f64::NAN;
    }
    median(times.into_iter().skip(20).collect())
}

struct Run {
    ids: Vec<u32>,
    tok_s: f64,
    speculation: Option<SpecStats>,
}

/// Greedy at `temperature` 0, else sampled with seed 1; `draft` 0: plain decoding.
fn decode(e: &Engine, prompt: &[u32], tokens: usize, temperature: f32, draft: usize) -> Run {
    let g = generate_with_drafts(
        &e.model,
        prompt,
        tokens,
        &mut Sampler::new(SamplingParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
            ..Default::default()
        }),
        &[],
        ForwardOptions::default(),
        DraftOptions {
            max: draft,
            ..Default::default()
        },
    )
    .unwrap();
    Run {
        tok_s: g.decode_tok_s(),
        ids: g.ids,
        speculation: g.speculation,
    }
}

fn main() {
    let a = args();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if a.pin {
        assert!(
            a.workers == 1 && cores >= 2,
            "--pin takes one worker and two cores"
        );
        // before any thread starts: the runtime's and the compute pool's threads inherit it
        pin_to(0);
        charm_shared::par::set_threads(1);
        println!("pinned: this process (coordinator, 1 compute thread) on core 0, the worker (--threads 1) on core 1");
    }
    let act = match a.act.as_str() {
        "int8" => Activations::Int8,
        _ => Activations::F32,
    };
    let opts = EngineOptions {
        history: HistoryPolicy::Off,
        activations: act,
        context: a.tokens + 16,
        dense_device: if a.dense_gpu {
            DenseDevice::Gpu
        } else {
            DenseDevice::Cpu
        },
        ..Default::default()
    };
    let prompt: Vec<u32> = (0..8).map(|i| (i * 37 + 11) % 1000 + 2).collect();
    let isa = format!("{:?}", charm_shared::quant::active_isa());
    println!(
        "model {}, {} workers, {} tokens, activations {}, ISA {isa}, {} cores, dense pass on the {}",
        a.model.display(),
        a.workers,
        a.tokens,
        a.act,
        cores,
        if a.dense_gpu { "GPU" } else { "CPU" }
    );

    let single = Engine::load(&a.model, &opts).unwrap();
    let spec = single.model.spec.clone();
    let plan = a.predict.then(|| {
        let input = charm_coordinator::ops::plan::PlanInput {
            dense_on_gpu: a.dense_gpu,
            ..Default::default()
        };
        charm_coordinator::ops::plan::plan(&a.model, &input).unwrap()
    });
    let moe = moe_layers(&spec)
        .iter()
        .filter(|l| l.0 < spec.layers.len())
        .count();
    let (h, k) = (
        spec.hidden_size,
        spec.router.as_ref().map_or(0, |r| r.top_k),
    );
    let temp = a.temperature;
    decode(&single, &prompt, 4, temp, 0); // warm-up
    let base = decode(&single, &prompt, a.tokens, temp, 0);
    let base2 = decode(&single, &prompt, a.tokens, temp, 0);
    let base_tok_s = base.tok_s.max(base2.tok_s);
    println!(
        "single process: {base_tok_s:.2} tok/s decode (best of {:.2}, {:.2})",
        base.tok_s, base2.tok_s
    );
    drop(single);

    let exe = PathBuf::from(env!("CARGO_BIN_EXE_charm"));
    // the workers share this machine's cores: each gets its share of them
    let per = if a.pin { 1 } else { (cores / a.workers).max(1) };
    let mut worker_args = vec!["--threads".to_string(), per.to_string()];
    // pinned, each process has a core of its own, as on separate machines: the defaults of
    // `charm worker` and the cluster file; unpinned, they share the cores: none (as `Loopback`)
    let spin = match (a.spin_us, a.pin) {
        (Some(us), _) => Some((us, Duration::from_micros(us))),
        (None, true) => Some((
            charm_worker::server::WORKER_SPIN_US,
            charm_coordinator::cluster::COORDINATOR_SPIN,
        )),
        (None, false) => None,
    };
    match spin {
        Some((w, c)) => {
            worker_args.extend(["--spin-us".to_string(), w.to_string()]);
            println!(
                "spin: workers {w} us after an answer, coordinator {} us per wait",
                c.as_micros()
            );
        }
        None => println!("spin: none (the processes share the cores)"),
    }
    let worker_args: Vec<&str> = worker_args.iter().map(String::as_str).collect();
    let lb = Loopback::start(&exe, &a.model, a.workers, &a.act, &worker_args).unwrap();
    if a.pin {
        for pid in lb.pids() {
            let ok = std::process::Command::new("taskset")
                .args(["-a", "-p", "-c", "1", &pid.to_string()])
                .stdout(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "taskset could not pin the worker");
        }
    }
    for &delay_ms in &a.delays {
        let delay = (delay_ms > 0.0).then(|| Duration::from_secs_f64(delay_ms / 1e3));
        let relays: Vec<Relay> = match delay {
            Some(d) => lb
                .workers
                .iter()
                .map(|w| Relay::start(w.addr, d / 2))
                .collect(),
            None => vec![],
        };
        let mut c = lb.options();
        if let Some((_, c_spin)) = spin {
            c.spin = c_spin;
        }
        if !relays.is_empty() {
            c.workers = lb
                .workers
                .iter()
                .zip(&relays)
                .map(|(w, r)| WorkerAddr {
                    name: w.name.clone(),
                    addr: r.addr,
                })
                .collect();
        }
        let e = Engine::load(
            &a.model,
            &EngineOptions {
                cluster: Some(c),
                ..opts.clone()
            },
        )
        .unwrap();
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
        let r = e.remote.clone().unwrap();
        decode(&e, &prompt, 4, temp, 0);
        // `charm plan --cluster`'s prediction, probed through the same client, the dense pass
        // timed halfway through the decode
        let predicted = plan.as_ref().map(|plan| {
            let o = probe::LiveOptions {
                act,
                draft: 0,
                acceptance: 0.0,
                position: prompt.len() + a.tokens / 2,
                worker_disk_bytes_s: probe::WORKER_DISK_BYTES_S,
                dense_gpu: a.dense_gpu,
            };
            probe::predict_live(&a.model, &r, &spec, plan, o).unwrap()
        });
        let s0 = r.status();
        let run = decode(&e, &prompt, a.tokens, temp, 0);
        assert_eq!(run.ids, base.ids, "the cluster changed the tokens");
        assert_eq!(r.fallbacks(), 0, "experts ran on the coordinator");
        let s1 = r.status();
        // token passes in the window: the prompt's prefill and the decode steps
        let passes = (prompt.len() + a.tokens - 1) as f64;
        let (mut reqs, mut up, mut down) = (0u64, 0u64, 0u64);
        let (mut rtt, mut compute) = (0.0, 0.0);
        for (x, y) in s0.iter().zip(&s1) {
            reqs += y.requests - x.requests;
            up += y.bytes_sent - x.bytes_sent;
            down += y.bytes_received - x.bytes_received;
            rtt += y.mean_rtt_ms * y.requests as f64 - x.mean_rtt_ms * x.requests as f64;
            compute +=
                y.mean_compute_ms * y.requests as f64 - x.mean_compute_ms * x.requests as f64;
        }
        let n = reqs.max(1) as f64;
        let (rtt, compute) = (rtt / n, compute / n);
        // each request's rest (its round trip less the worker's compute), for the median: the
        // echoes below are medians too
        let timed: Vec<(u32, f64)> = s0
            .iter()
            .enumerate()
            .flat_map(|(i, x)| {
                r.recent(i)
                    .into_iter()
                    .filter(|t| t.seq > x.requests)
                    .map(|t| (t.layer, t.rtt_ns.saturating_sub(t.compute_ns) as f64 / 1e6))
            })
            .collect();
        let rest_median = median(timed.iter().map(|t| t.1).collect());
        // the same per MoE layer: the first after the dense pass (the output layer, the dense
        // layers) finds the network path's code and data evicted from the core's caches
        let mut per_layer: std::collections::BTreeMap<u32, Vec<f64>> = Default::default();
        for &(l, rest) in &timed {
            per_layer.entry(l).or_default().push(rest);
        }
        let by_layer: Vec<(u32, f64)> =
            per_layer.into_iter().map(|(l, v)| (l, median(v))).collect();
        // the mean request's and answer's sizes
        let (up_n, down_n) = ((up as f64 / n) as usize, (down as f64 / n) as usize);
        let echo_of = |polled: Option<Duration>| {
            quic_echo(
                &lb.dir,
                up_n,
                down_n,
                delay,
                a.pin.then_some(1),
                per,
                polled,
            )
        };
        let echo = echo_of(None);
        // where both sides poll (pinned, by default), the same echo with its sides polling too
        let polled = match spin {
            Some((w, c)) if w > 0 && !c.is_zero() && delay.is_none() => {
                Some(echo_of(Some(Duration::from_micros(w))))
            }
            _ => None,
        };
        let udp = udp_echo(up_n, down_n, a.pin.then_some(1));
        let wire = (up + down) as f64 / passes;
        // exact scheme's floor: top_k unweighted rows back, one activation row out (as int8
        // codes with a scale per group when the requests carried codes)
        let coded: u64 = s0
            .iter()
            .zip(&s1)
            .map(|(x, y)| y.coded_requests - x.coded_requests)
            .sum();
        let g = s1.iter().map(|w| w.act_group).max().unwrap_or(0) as f64;
        let row_out = if coded == reqs && g > 0.0 {
            h as f64 * (1.0 + 4.0 / g)
        } else {
            (h * 4) as f64
        };
        let floor = moe as f64 * ((k * h * 4) as f64 + row_out);
        // the requests of a layer run in parallel: its network time is a round trip less the
        // worker's compute; a token crosses `moe` layers
        let net = moe as f64 * (rtt - compute);
        let (udp_ratio, udp_ms) = if udp.is_nan() {
            (
                "no raw UDP figure".to_string(),
                "lost (no figure)".to_string(),
            )
        } else {
            (
                format!(
                    "{:.2}x the raw UDP echo; per request median {rest_median:.3} ms, {:.2}x",
                    (rtt - compute) / udp,
                    rest_median / udp
                ),
                format!("{udp:.3} ms"),
            )
        };
        println!(
            "added RTT {delay_ms} ms: decode {:.2} tok/s = {:.2}x single | per layer request: round trip {rtt:.3} ms, worker compute {compute:.3} ms, rest {:.3} ms ({}); raw UDP echo of the same sizes {}, bare QUIC echo {echo:.3} ms{} | wire {:.1} KB/token = {:.2}x the exact scheme's floor {:.1} KB | network per token {net:.2} ms vs {moe} MoE layers x RTT: {}",
            run.tok_s,
            run.tok_s / base_tok_s,
            rtt - compute,
            udp_ratio,
            udp_ms,
            polled.map_or(String::new(), |p| format!(
                ", with both sides polling {p:.3} ms ({:.2}x the raw UDP echo; rest {:.2}x it, median {:.2}x)",
                p / udp,
                (rtt - compute) / p,
                rest_median / p
            )),
            wire / 1e3,
            wire / floor,
            floor / 1e3,
            if delay_ms > 0.0 {
                format!(
                    "{:.2} ms added ({:.2}x), {:.2} ms with the relay's measured echo ({:.2}x)",
                    moe as f64 * delay_ms,
                    net / (moe as f64 * delay_ms),
                    moe as f64 * echo,
                    net / (moe as f64 * echo)
                )
            } else {
                format!(
                    "{:.2} ms bare loopback echo ({:.2}x)",
                    moe as f64 * echo,
                    net / (moe as f64 * echo)
                )
            },
        );
        if !udp.is_nan() && by_layer.len() > 1 {
            println!(
                "added RTT {delay_ms} ms: rest per request by MoE layer, median (x the raw UDP echo): {}",
                by_layer
                    .iter()
                    .map(|(l, m)| format!("layer {l} {m:.4} ms ({:.2}x)", m / udp))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        if let Some(p) = &predicted {
            let t = &p.token;
            println!(
                "added RTT {delay_ms} ms: predicted {:.2} tok/s, measured {:.2} = {:+.1}% | predicted per token: dense {:.3} ms, round trips {:.3} ms, transfer {:.3} ms, experts {:.3} ms, hidden {:.3} ms; bottleneck {}",
                p.tok_s,
                run.tok_s,
                100.0 * (p.tok_s / run.tok_s - 1.0),
                t.dense_ms,
                t.round_trips_ms,
                t.transfer_ms,
                t.expert_compute_ms + t.expert_disk_ms,
                t.overlap_ms,
                p.bottleneck
            );
        }
        if a.draft > 0 {
            let spec_run = decode(&e, &prompt, a.tokens, temp, a.draft);
            assert_eq!(spec_run.ids, base.ids, "speculation changed the tokens");
            let s = spec_run.speculation.expect("speculation ran");
            println!(
                "added RTT {delay_ms} ms, --draft {} ({}): decode {:.2} tok/s = {:.2}x without drafts | {:.2} tokens per step, {} of {} drafts accepted ({:.0}%), steps by drafts {:?}",
                a.draft,
                s.source,
                spec_run.tok_s,
                spec_run.tok_s / run.tok_s,
                (spec_run.ids.len() - 1) as f64 / s.steps.max(1) as f64,
                s.accepted,
                s.drafted,
                100.0 * s.acceptance(),
                s.steps_by_drafts
            );
        }
        drop(e);
        drop(relays);
    }
}
