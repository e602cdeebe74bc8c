//! Fuzzes the cluster wire decoder: any payload must decode to a message or give a clean error,
//! and a decoded compute request must pass or fail its checks cleanly; never a panic. Run with
//! `cargo fuzz run wire_message`.
#![no_main]

use charm_shared::wire::{decode, Limits, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        hidden: 8,
        n_experts: 16,
        max_tokens: 64,
    };
    match decode(data) {
        Ok(Message::Compute(r)) => {
            let _ = r.check(&limits);
        }
        Ok(Message::Computed(res)) => {
            let _ = res.out.len();
        }
        _ => {}
    }
});
