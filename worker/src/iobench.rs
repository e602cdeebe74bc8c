//! The disk benchmark behind `charm iobench`: random aligned reads of expert-sized blocks from a
//! container's expert files or a scratch file, optionally beside threads streaming memory (as a
//! forward pass does: on some machines, VMs especially, the disk reads slower then).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;

use charm_shared::container::Container;

use crate::io::{random_reads, AlignedBuf, Pages, ReadBench, RecordFile};

/// What to read.
#[derive(Debug, Clone)]
pub enum Source {
    /// The expert files of the container in this directory.
    Container(PathBuf),
    /// A scratch file of `bytes` made in `dir` and removed afterwards.
    Scratch { dir: PathBuf, bytes: u64 },
}

/// How to read.
#[derive(Debug, Clone)]
pub struct Config {
    /// Bytes per read, rounded up to a multiple of 4096.
    pub block: usize,
    pub seconds: f64,
    pub threads: usize,
    /// `O_DIRECT` where the filesystem allows.
    pub direct: bool,
    /// Threads streaming memory beside the reads (0: none), at most 64.
    pub memory_load: usize,
    pub pages: Pages,
}

/// What a run measured.
#[derive(Debug, Clone, Copy)]
pub struct Report {
    pub reads: ReadBench,
    /// Memory read bandwidth the load threads got (0 without them).
    pub memory_load_bytes_per_s: f64,
}

/// Runs the benchmark.
pub fn run(source: &Source, cfg: &Config) -> std::io::Result<Report> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    if cfg.block == 0 || cfg.block > 1 << 30 {
        return Err(bad(format!(
            "block of {} bytes is outside 1..=1 GiB",
            cfg.block
        )));
    }
    if cfg.memory_load > 64 {
        return Err(bad(format!(
            "{} memory-load threads (at most 64)",
            cfg.memory_load
        )));
    }
    let block = cfg.block.div_ceil(4096) * 4096;
    let mut scratch = None;
    let files: Vec<(RecordFile, u64)> = match source {
        Source::Container(m) => {
            let c = Container::open(m).map_err(|e| bad(e.to_string()))?;
            c.expert_layers()
                .map(|l| {
                    let p = m.join(&l.file);
                    Ok((
                        RecordFile::open(&p, cfg.direct)?,
                        l.record_bytes * l.count as u64,
                    ))
                })
                .collect::<std::io::Result<_>>()?
        }
        Source::Scratch { dir, bytes } => {
            let p = dir.join(format!("charm-iobench-{}.bin", std::process::id()));
            let len = bytes.div_ceil(block as u64).max(1) * block as u64;
            scratch = Some(p.clone());
            match write_scratch(&p, len, block).and_then(|_| RecordFile::open(&p, cfg.direct)) {
                Ok(f) => vec![(f, len)],
                Err(e) => {
                    let _ = std::fs::remove_file(&p);
                    return Err(e);
                }
            }
        }
    };
    let refs: Vec<(&RecordFile, u64)> = files.iter().map(|(f, n)| (f, *n)).collect();
    let stop = AtomicBool::new(false);
    // the reads start once every load thread has its buffer and streams
    let ready = Barrier::new(cfg.memory_load + 1);
    let (r, streamed) = std::thread::scope(|sc| {
        let loads: Vec<_> = (0..cfg.memory_load)
            .map(|_| sc.spawn(|| stream_memory(&stop, &ready)))
            .collect();
        ready.wait();
        let r = random_reads(
            &refs,
            block,
            cfg.threads,
            (u64::MAX, cfg.seconds),
            11,
            cfg.pages,
        );
        stop.store(true, Ordering::Relaxed);
        let streamed: (u64, f64) = loads
            .into_iter()
            .map(|h| h.join().expect("memory load thread panicked"))
            .fold((0, 0.0), |(b, t), (b2, t2)| (b + b2, f64::max(t, t2)));
        (r, streamed)
    });
    if let Some(p) = scratch {
        let _ = std::fs::remove_file(p);
    }
    Ok(Report {
        reads: r?,
        memory_load_bytes_per_s: if streamed.1 > 0.0 {
            streamed.0 as f64 / streamed.1
        } else {
            0.0
        },
    })
}

/// Fills a 256 MiB buffer, waits at `ready`, then sums the buffer over and over until `stop`
/// (at least one chunk); returns (bytes read, seconds).
fn stream_memory(stop: &AtomicBool, ready: &Barrier) -> (u64, f64) {
    let buf: Vec<u64> = (0..32u64 << 20).collect();
    ready.wait();
    let t = std::time::Instant::now();
    let (mut bytes, mut acc) = (0u64, 0u64);
    loop {
        for c in buf.chunks(1 << 16) {
            let mut l = [0u64; 8];
            for w in c.chunks_exact(8) {
                for k in 0..8 {
                    l[k] = l[k].wrapping_add(w[k]);
                }
            }
            acc = l.iter().fold(acc, |a, v| a.wrapping_add(*v));
            bytes += 8 * c.len() as u64;
            if stop.load(Ordering::Relaxed) {
                std::hint::black_box(acc);
                return (bytes, t.elapsed().as_secs_f64());
            }
        }
    }
}

/// Writes `len` bytes of pseudo-random blocks to `p` and syncs it.
fn write_scratch(p: &Path, len: u64, block: usize) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let named = |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", p.display()));
    let f = std::fs::File::create(p).map_err(named)?;
    let mut b = AlignedBuf::new(block);
    let mut s = 0x1234_5678u64;
    for c in b.as_mut_slice().chunks_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        c.copy_from_slice(&s.to_le_bytes()[..c.len()]);
    }
    let mut off = 0;
    while off < len {
        f.write_all_at(b.as_slice(), off).map_err(named)?;
        off += block as u64;
    }
    f.sync_all().map_err(named)
}
