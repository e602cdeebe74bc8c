//! The conversation KV log: what is stored comes back bit for bit, a torn or damaged tail is cut
//! at the last whole record wherever the write stopped, and nothing else is lost.

use std::path::{Path, PathBuf};

use charm_coordinator::serve::kvlog::{KvLog, Recovered};
use charm_coordinator::{ForwardOptions, KvCache, Model};
use proptest::prelude::*;

fn model() -> Model {
    // DSA `full` layers: the log stores indexer keys too
    Model::load(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/oracle/glm5-tiny"))
        .unwrap()
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + seed * 11 + 5) % 200)
        .collect()
}

fn cache_of(m: &Model, t: &[u32]) -> KvCache {
    let mut c = KvCache::new(&m.spec);
    m.forward(t, &mut c, ForwardOptions::default(), None)
        .unwrap();
    c
}

fn bits(c: &KvCache) -> Vec<Vec<u32>> {
    c.layers
        .iter()
        .map(|l| {
            l.kv.iter()
                .chain(&l.index_keys)
                .map(|v| v.to_bits())
                .collect()
        })
        .collect()
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("charm-kvlog-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn open(d: &Path, m: &Model) -> Result<(KvLog, Recovered), String> {
    KvLog::open(d, &m.spec, "fingerprint-a", 1 << 30)
}

/// A conversation of two turns: the second stored as an extension of the first.
fn two_turns(d: &Path, m: &Model) -> (Vec<u32>, KvCache, u64) {
    turns(d, m, 20, 9)
}

/// [`two_turns`] with a first turn of `n` tokens and `more` tokens after it: the whole
/// conversation, its cache and the log's size.
fn turns(d: &Path, m: &Model, n: usize, more: usize) -> (Vec<u32>, KvCache, u64) {
    let first = tokens(n, 1);
    let (mut log, found) = open(d, m).unwrap();
    assert_eq!(found.records, 0);
    let a = log.append(None, &first, &cache_of(m, &first)).unwrap();
    let mut second = first.clone();
    second.extend(tokens(more, 2));
    let c2 = cache_of(m, &second);
    log.append(Some((a, n)), &second, &c2).unwrap();
    (second, c2, log.bytes())
}

#[test]
fn stored_sequences_come_back_bit_for_bit_after_reopening() {
    let m = model();
    let d = dir("roundtrip");
    let (second, c2, _) = two_turns(&d, &m);
    let (log, found) = open(&d, &m).unwrap();
    assert_eq!(
        found,
        Recovered {
            records: 2,
            cut_bytes: 0
        }
    );
    let mut prompt = second.clone();
    prompt.push(3);
    let (seq, n) = log.best(&prompt).unwrap();
    assert_eq!(n, second.len());
    assert_eq!(bits(&log.load(seq).unwrap()), bits(&c2));
    // the first turn's 20 tokens: the longer conversation holds them
    let (s1, n1) = log.best(&tokens(20, 1)).unwrap();
    assert_eq!((s1, n1), (seq, 20));
    let mut c1 = log.load(s1).unwrap();
    c1.truncate(20);
    assert_eq!(bits(&c1), bits(&cache_of(&m, &tokens(20, 1))));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_torn_tail_is_cut_at_the_last_whole_record_wherever_the_write_stopped() {
    let m = model();
    let d = dir("torn");
    // a short conversation, so that every cut point is tried in a few seconds: a record's
    // layout (frame, then a payload of every layer's KV and indexer keys per token) is the same
    // whatever its length
    let (n, more) = (6, 2);
    let first = tokens(n, 1);
    let (mut log, _) = open(&d, &m).unwrap();
    log.append(None, &first, &cache_of(&m, &first)).unwrap();
    let whole_one = log.bytes();
    drop(log);
    let (_, _, whole_two) = turns(&dir("torn-ref"), &m, n, more);
    // the same two records, then cut at every length inside the second (a kill -9 mid-write):
    // every byte offset from its first byte to its last
    let full = {
        let r = dir("torn-full");
        turns(&r, &m, n, more);
        std::fs::read(r.join("kv.log")).unwrap()
    };
    assert_eq!(full.len() as u64, whole_two);
    for cut in whole_one as usize..whole_two as usize {
        std::fs::write(d.join("kv.log"), &full[..cut]).unwrap();
        let (log, found) = open(&d, &m).unwrap();
        assert_eq!(found.records, 1, "cut at {cut}");
        assert_eq!(found.cut_bytes, cut as u64 - whole_one);
        assert_eq!(log.bytes(), whole_one);
        assert_eq!(
            std::fs::metadata(d.join("kv.log")).unwrap().len(),
            whole_one
        );
    }
    // a damaged byte in the last record cuts that record
    let mut bad = full.clone();
    let at = whole_one as usize + (whole_two - whole_one) as usize / 2;
    bad[at] ^= 0x40;
    std::fs::write(d.join("kv.log"), &bad).unwrap();
    let (mut log, found) = open(&d, &m).unwrap();
    assert_eq!(found.records, 1);
    // and the log goes on from there
    let next = tokens(18, 7);
    log.append(None, &next, &cache_of(&m, &next)).unwrap();
    drop(log);
    assert_eq!(open(&d, &m).unwrap().1.records, 2);
    for n in ["torn", "torn-ref", "torn-full"] {
        let _ = std::fs::remove_dir_all(dir(n));
    }
}

#[test]
fn another_models_log_and_foreign_files_are_refused_clearly() {
    let m = model();
    let d = dir("foreign");
    two_turns(&d, &m);
    let e = KvLog::open(&d, &m.spec, "fingerprint-b", 1 << 30).unwrap_err();
    assert!(e.contains("another model"), "{e}");
    std::fs::write(d.join("kv.log"), b"not a log at all, just some bytes").unwrap();
    let e = open(&d, &m).unwrap_err();
    assert!(e.contains("not a charm KV log"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn past_its_budget_the_log_keeps_the_most_recent_sequences() {
    let m = model();
    let d = dir("budget");
    let one = {
        let (mut log, _) = KvLog::open(&d, &m.spec, "f", u64::MAX).unwrap();
        let t = tokens(30, 0);
        let before = log.bytes();
        log.append(None, &t, &cache_of(&m, &t)).unwrap();
        log.bytes() - before
    };
    let _ = std::fs::remove_dir_all(&d);
    let budget = 5 * one;
    let (mut log, _) = KvLog::open(&d, &m.spec, "f", budget).unwrap();
    let mut last = Vec::new();
    for s in 0..12 {
        last = tokens(30, s);
        log.append(None, &last, &cache_of(&m, &last)).unwrap();
        assert!(log.bytes() <= budget, "{} > {budget}", log.bytes());
    }
    let (seq, n) = log.best(&last).unwrap();
    assert_eq!(n, 30);
    assert_eq!(bits(&log.load(seq).unwrap()), bits(&cache_of(&m, &last)));
    drop(log);
    let (log, found) = KvLog::open(&d, &m.spec, "f", budget).unwrap();
    assert_eq!(found.cut_bytes, 0);
    assert!(found.records >= 2 && found.records < 12);
    assert_eq!(log.best(&last).unwrap().1, 30);
    let _ = std::fs::remove_dir_all(&d);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Whatever follows the whole records (garbage, a half frame, a forged header), opening
    /// keeps exactly the whole records and never panics.
    #[test]
    fn any_tail_after_whole_records_is_cut(tail in proptest::collection::vec(any::<u8>(), 0..600), forge in any::<bool>()) {
        let m = model();
        let d = dir(&format!("prop-{}", tail.len()));
        let (_, _, whole) = two_turns(&d, &m);
        let mut bytes = std::fs::read(d.join("kv.log")).unwrap();
        if forge && tail.len() >= 16 {
            // a frame header that claims a record the file does not hold
            let mut t = tail.clone();
            t[..4].copy_from_slice(&0x5256_4b43u32.to_le_bytes());
            bytes.extend_from_slice(&t);
        } else {
            bytes.extend_from_slice(&tail);
        }
        std::fs::write(d.join("kv.log"), &bytes).unwrap();
        let (log, found) = open(&d, &m).unwrap();
        prop_assert_eq!(found.records, 2);
        prop_assert_eq!(log.bytes(), whole);
        let _ = std::fs::remove_dir_all(&d);
    }
}
