//! Fuzzes the safetensors header parser: any bytes must give `Ok` with every tensor inside the
//! file, or a clean error; never a panic. Run with `cargo fuzz run safetensors_header`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = charm_shared::safetensors::parse_header(data, data.len() as u64) {
        let data_len = data.len() - h.data_start;
        for t in h.tensors.values() {
            assert!(t.begin <= t.end && t.end <= data_len);
        }
    }
});
