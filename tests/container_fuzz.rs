//! A container is untrusted input too (a damaged download, a hand-edited manifest): random
//! changes to the numbers in `charm.json` and to bytes of its data files must give a clean load
//! error or a working model, never a panic.

use std::path::Path;

use charm_coordinator::Model;
use proptest::prelude::*;

mod common;
use common::{convert, fixture, scratch};

fn container() -> &'static Path {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let out = scratch("fuzz-src");
        assert!(convert(&fixture("glm5-tiny"), &out, &["--experts", "int2"], None).0);
        out
    })
}

fn copy(tag: &str) -> std::path::PathBuf {
    let d = scratch(tag);
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(container()).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
    }
    d
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn manifest_numbers(which in any::<prop::sample::Index>(), value in prop_oneof![Just(0u64), Just(1), Just(7), Just(4096), Just(u32::MAX as u64), Just(u64::MAX / 3), Just(u64::MAX), any::<u64>()]) {
        let d = copy("fuzz-num");
        let mp = d.join("charm.json");
        let text = std::fs::read_to_string(&mp).unwrap();
        // positions of every number in the manifest
        let bytes = text.as_bytes();
        let mut spans = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i].is_ascii_digit() && (i == 0 || !(bytes[i - 1] as char).is_ascii_alphanumeric() && bytes[i - 1] != b'-' && bytes[i - 1] != b'_') {
                let s = i;
                while i < bytes.len() && bytes[i].is_ascii_digit() {
                    i += 1;
                }
                spans.push((s, i));
            } else {
                i += 1;
            }
        }
        let (s, e) = spans[which.index(spans.len())];
        let mutated = format!("{}{}{}", &text[..s], value, &text[e..]);
        std::fs::write(&mp, mutated).unwrap();
        let r = std::panic::catch_unwind(|| Model::load(&d).map(|_| ()));
        std::fs::remove_dir_all(&d).unwrap();
        prop_assert!(r.is_ok(), "loading panicked after setting a manifest number to {}", value);
    }

    #[test]
    fn data_bytes(file in 0usize..5, pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let d = copy("fuzz-byte");
        let mut names: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "bin")).collect();
        names.sort();
        let p = &names[file % names.len()];
        let mut b = std::fs::read(p).unwrap();
        let i = pos.index(b.len());
        b[i] = byte;
        std::fs::write(p, &b).unwrap();
        let r = std::panic::catch_unwind(|| Model::load(&d).map(|_| ()));
        std::fs::remove_dir_all(&d).unwrap();
        prop_assert!(r.is_ok(), "loading panicked after a byte change in {}", p.display());
    }
}
