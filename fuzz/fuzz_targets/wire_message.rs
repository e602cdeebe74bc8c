//! Fuzzes the cluster wire decoder: any payload must decode to a message or give a clean error,
//! the coordinator's in-place read of results must agree with it, and a decoded compute request
//! must pass or fail its checks cleanly; never a panic. Run with
//! `cargo fuzz run wire_message`.
#![no_main]

use charm_shared::wire::{decode, receive, Limits, Message, Payload, Received};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        hidden: 8,
        n_experts: 16,
        max_tokens: 64,
    };
    // the coordinator's in-place read of results must agree with the decoder
    let mut aligned = Payload::with_capacity(data.len());
    aligned.extend_from_slice(data);
    match (receive(aligned), decode(data)) {
        (Ok(Received::Computed(v)), Ok(Message::Computed(m))) => assert_eq!(v.out(), &m.out[..]),
        (Ok(Received::Other(o)), Ok(m)) => assert_eq!(o, m),
        (Err(_), Err(_)) => {}
        _ => panic!("receive and decode disagree"),
    }
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
