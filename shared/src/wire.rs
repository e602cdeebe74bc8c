//! The cluster wire protocol: the typed messages a coordinator and its expert workers exchange,
//! their framing, and the checks every received message passes before anything uses it. No
//! sockets here: the transport (QUIC with mutual TLS) lives in the worker and the coordinator.
//!
//! A frame is a 4-byte little-endian payload length, then the payload: one [`Message`] archived
//! with rkyv. [`decode`] refuses a frame over [`MAX_FRAME`], validates the archive (bytecheck)
//! before reading it, and [`ComputeRequest::check`] / [`ComputeResult::check`] refuse shapes that
//! do not match the model or the request. Messages carry numbers and byte arrays only: never code,
//! graphs, pointers or file paths.
//!
//! **Exactness.** A worker returns each routed expert's output rows unweighted; the coordinator
//! adds them with [`crate::expert::combine`] in ascending expert order, as single-box does, so the
//! result is bit-identical whatever the placement. This costs `top_k x hidden x 4` bytes per token
//! and MoE layer on the way back (192 KiB for GLM-5.2: 8 experts of 6144 floats, minus the slots a
//! coordinator computes itself), against `hidden x 4` per worker for partial sums computed on the
//! workers, which would change the order of the additions and so the bits.

use rkyv::{Archive, Deserialize, Serialize};

/// Protocol version; a peer speaking another is refused at the handshake.
pub const PROTOCOL_VERSION: u32 = 1;
/// Bytes of the frame length prefix.
pub const LEN_BYTES: usize = 4;
/// Largest payload accepted (a 512-token step of GLM-5.2's 6144-wide activations is 12 MiB).
pub const MAX_FRAME: usize = 64 << 20;
const _: () = assert!(MAX_FRAME <= u32::MAX as usize && LEN_BYTES == std::mem::size_of::<u32>());

/// Everything that crosses the wire.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Message {
    /// First message of a connection, both ways.
    Hello(Hello),
    /// The handshake failed; the connection closes.
    Refused {
        reason: String,
    },
    /// Coordinator -> worker: compute some experts of one MoE layer.
    Compute(ComputeRequest),
    /// Worker -> coordinator: the outputs of a [`ComputeRequest`].
    Computed(ComputeResult),
    /// Worker -> coordinator: a request could not be served.
    Failed {
        id: u64,
        /// What the caller can do: see [`FailureClass`].
        class: FailureClass,
        message: String,
    },
    Ping {
        seq: u64,
    },
    Pong {
        seq: u64,
    },
    /// Coordinator -> worker: the experts placed on it; a worker that fetches its shard fetches
    /// those it lacks.
    Assign {
        experts: Vec<LayerExperts>,
    },
    /// Worker -> coordinator: `len` bytes (at most [`MAX_CHUNK`]) at `offset` of the record of
    /// `expert` of `layer`, in the container both share.
    Fetch {
        layer: u32,
        expert: u32,
        offset: u64,
        len: u32,
    },
    /// Coordinator -> worker: the bytes a [`Message::Fetch`] asked for.
    Chunk {
        layer: u32,
        expert: u32,
        offset: u64,
        data: Vec<u8>,
    },
}

/// Largest piece of an expert record one [`Message::Chunk`] carries.
pub const MAX_CHUNK: usize = 8 << 20;
const _: () = assert!(MAX_CHUNK + 4096 <= MAX_FRAME);

/// Why a request failed, by what the caller can do about it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// The request itself was wrong: retrying it anywhere fails the same way.
    BadRequest,
    /// This worker cannot serve it now: another holder may.
    Unavailable,
    /// Something broke on the worker.
    Internal,
}

/// A peer's identity and what it holds.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Hello {
    pub version: u32,
    /// Node name (as in its certificate).
    pub node: String,
    /// Fingerprint of the model the peer runs (config, tensor index, expert checksums): peers of
    /// different models never exchange activations.
    pub model: String,
    /// Activation modes the peer computes in (`"f32"`, `"int8"`).
    pub activations: Vec<String>,
    /// The experts the peer holds, per MoE layer (empty for a coordinator).
    pub experts: Vec<LayerExperts>,
    /// RAM the peer gives its experts, bytes.
    pub ram_bytes: u64,
    /// Expert rows the peer computed per second when it started (0: not measured).
    pub expert_rate: f64,
    /// The peer fetches the records of the experts placed on it that it lacks (it may then
    /// be given any expert; see [`Message::Assign`]).
    pub fetches: bool,
}

/// Expert ids of one layer, ascending.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct LayerExperts {
    pub layer: u32,
    pub ids: Vec<u32>,
}

/// Run experts of one layer over some tokens.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ComputeRequest {
    /// Request id, unique per connection; the result carries it back.
    pub id: u64,
    /// Forward step and layer: the same (step, layer) is the same work, so a retry elsewhere is
    /// recognizable.
    pub step: u64,
    pub layer: u32,
    pub hidden: u32,
    /// Activation mode the experts multiply in (`"f32"` or `"int8"`).
    pub activations: String,
    /// `[tokens, hidden]` activations of the tokens some run needs, f32.
    pub x: Vec<f32>,
    /// One run per expert, ascending expert ids.
    pub runs: Vec<Run>,
}

/// One expert and the rows of [`ComputeRequest::x`] it runs on, in the order its outputs return.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub expert: u32,
    pub rows: Vec<u32>,
}

/// The outputs of a [`ComputeRequest`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ComputeResult {
    pub id: u64,
    /// Microseconds the worker spent computing (statistics only: the round trip less this is
    /// what the network and framing cost).
    pub compute_us: u64,
    /// Per run, `[rows, hidden]` unweighted expert outputs.
    pub outputs: Vec<Vec<f32>>,
}

/// A frame or message that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("message does not fit the request or the model: {0}")]
    Shape(String),
}

/// What the receiver knows of the model, to check requests against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub hidden: usize,
    pub n_experts: usize,
    /// Tokens one request may carry.
    pub max_tokens: usize,
}

/// A frame: the length prefix, then `m` archived.
pub fn encode(m: &Message) -> Result<Vec<u8>, WireError> {
    let body = rkyv::to_bytes::<rkyv::rancor::Error>(m)
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(WireError::TooLarge(body.len()));
    }
    let mut f = Vec::with_capacity(LEN_BYTES + body.len());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(&body);
    Ok(f)
}

/// The payload length a frame's prefix announces, refused past [`MAX_FRAME`].
pub fn frame_len(prefix: [u8; LEN_BYTES]) -> Result<usize, WireError> {
    let n = u32::from_le_bytes(prefix) as usize;
    if n > MAX_FRAME {
        return Err(WireError::TooLarge(n));
    }
    Ok(n)
}

/// A message from a frame's payload, validated before it is read.
pub fn decode(payload: &[u8]) -> Result<Message, WireError> {
    if payload.len() > MAX_FRAME {
        return Err(WireError::TooLarge(payload.len()));
    }
    // rkyv reads archives in place: give it the alignment it needs.
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(payload.len());
    aligned.extend_from_slice(payload);
    rkyv::from_bytes::<Message, rkyv::rancor::Error>(&aligned)
        .map_err(|e| WireError::Malformed(e.to_string()))
}

fn shape(m: String) -> WireError {
    WireError::Shape(m)
}

impl ComputeRequest {
    /// Tokens carried.
    pub fn tokens(&self) -> usize {
        self.x.len() / (self.hidden as usize).max(1)
    }

    /// Refuses a request that does not fit `limits`: another width, a partial row, too many
    /// tokens, unknown or unsorted experts, rows out of range or repeated within a run.
    pub fn check(&self, limits: &Limits) -> Result<(), WireError> {
        let h = self.hidden as usize;
        if h != limits.hidden {
            return Err(shape(format!(
                "hidden {h}, the model's is {}",
                limits.hidden
            )));
        }
        if h == 0 || !self.x.len().is_multiple_of(h) {
            return Err(shape(format!(
                "{} activations are not whole rows of {h}",
                self.x.len()
            )));
        }
        let tokens = self.x.len() / h;
        if tokens == 0 || tokens > limits.max_tokens {
            return Err(shape(format!(
                "{tokens} tokens (1..={} allowed)",
                limits.max_tokens
            )));
        }
        if !matches!(self.activations.as_str(), "f32" | "int8") {
            return Err(shape(format!(
                "activation mode `{}` (f32 or int8)",
                self.activations
            )));
        }
        if self.runs.is_empty() {
            return Err(shape("no experts to run".into()));
        }
        let mut last = None;
        for r in &self.runs {
            if r.expert as usize >= limits.n_experts {
                return Err(shape(format!(
                    "expert {} of a layer with {}",
                    r.expert, limits.n_experts
                )));
            }
            if last.is_some_and(|l| l >= r.expert) {
                return Err(shape("runs are not in ascending expert order".into()));
            }
            last = Some(r.expert);
            if r.rows.is_empty() || r.rows.len() > tokens {
                return Err(shape(format!(
                    "expert {} runs on {} of {tokens} rows",
                    r.expert,
                    r.rows.len()
                )));
            }
            let mut seen = vec![false; tokens];
            for &row in &r.rows {
                match seen.get_mut(row as usize) {
                    Some(s) if !*s => *s = true,
                    Some(_) => {
                        return Err(shape(format!("row {row} repeated for expert {}", r.expert)))
                    }
                    None => return Err(shape(format!("row {row} of {tokens}"))),
                }
            }
        }
        Ok(())
    }
}

impl ComputeResult {
    /// Refuses a result that does not answer `req`: another id, another number of runs, or
    /// outputs that are not `[rows, hidden]` per run.
    pub fn check(&self, req: &ComputeRequest) -> Result<(), WireError> {
        if self.id != req.id {
            return Err(shape(format!("result {} for request {}", self.id, req.id)));
        }
        if self.outputs.len() != req.runs.len() {
            return Err(shape(format!(
                "{} outputs for {} experts",
                self.outputs.len(),
                req.runs.len()
            )));
        }
        for (o, r) in self.outputs.iter().zip(&req.runs) {
            if Some(o.len()) != r.rows.len().checked_mul(req.hidden as usize) {
                return Err(shape(format!(
                    "expert {}: {} values for {} rows of {}",
                    r.expert,
                    o.len(),
                    r.rows.len(),
                    req.hidden
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn request(tokens: usize, hidden: usize, runs: Vec<Run>) -> ComputeRequest {
        ComputeRequest {
            id: 7,
            step: 3,
            layer: 2,
            hidden: hidden as u32,
            activations: "f32".into(),
            x: (0..tokens * hidden).map(|i| i as f32 * 0.5 - 1.0).collect(),
            runs,
        }
    }

    const LIMITS: Limits = Limits {
        hidden: 8,
        n_experts: 16,
        max_tokens: 64,
    };

    #[test]
    fn messages_survive_a_round_trip() {
        let req = request(
            3,
            8,
            vec![
                Run {
                    expert: 1,
                    rows: vec![0, 2],
                },
                Run {
                    expert: 9,
                    rows: vec![1],
                },
            ],
        );
        for m in [
            Message::Compute(req.clone()),
            Message::Computed(ComputeResult {
                id: 7,
                compute_us: 120,
                outputs: vec![vec![1.5; 16], vec![-0.0; 8]],
            }),
            Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                node: "a".into(),
                model: "m".into(),
                activations: vec!["f32".into()],
                experts: vec![LayerExperts {
                    layer: 1,
                    ids: vec![0, 3],
                }],
                ram_bytes: 1 << 30,
                expert_rate: 1e4,
                fetches: false,
            }),
            Message::Failed {
                id: 1,
                class: FailureClass::Unavailable,
                message: "x".into(),
            },
            Message::Ping { seq: 9 },
            Message::Assign {
                experts: vec![LayerExperts {
                    layer: 3,
                    ids: vec![1, 2],
                }],
            },
            Message::Fetch {
                layer: 3,
                expert: 1,
                offset: 4096,
                len: 8192,
            },
            Message::Chunk {
                layer: 3,
                expert: 1,
                offset: 4096,
                data: vec![7; 100],
            },
        ] {
            let f = encode(&m).unwrap();
            let n = frame_len(f[..4].try_into().unwrap()).unwrap();
            assert_eq!(n, f.len() - 4);
            assert_eq!(decode(&f[4..]).unwrap(), m);
        }
        assert_eq!(req.check(&LIMITS), Ok(()));
    }

    #[test]
    fn requests_that_do_not_fit_the_model_are_refused() {
        let ok = |runs| request(3, 8, runs);
        let run = |expert, rows: &[u32]| Run {
            expert,
            rows: rows.to_vec(),
        };
        for (bad, why) in [
            (ok(vec![run(16, &[0])]), "expert 16"),
            (ok(vec![run(3, &[0]), run(2, &[1])]), "ascending"),
            (ok(vec![run(3, &[0, 0])]), "repeated"),
            (ok(vec![run(3, &[3])]), "row 3 of 3"),
            (ok(vec![run(3, &[])]), "0 of 3"),
            (ok(vec![]), "no experts"),
            (request(3, 4, vec![run(1, &[0])]), "hidden 4"),
            (request(65, 8, vec![run(1, &[0])]), "65 tokens"),
        ] {
            let e = bad.check(&LIMITS).unwrap_err().to_string();
            assert!(e.contains(why), "{e} (wanted {why})");
        }
        let mut partial = ok(vec![run(1, &[0])]);
        partial.x.pop();
        assert!(partial.check(&LIMITS).is_err());
        let mut mode = ok(vec![run(1, &[0])]);
        mode.activations = "f16".into();
        assert!(mode.check(&LIMITS).is_err());
    }

    #[test]
    fn results_must_answer_their_request() {
        let req = request(
            2,
            8,
            vec![Run {
                expert: 1,
                rows: vec![0, 1],
            }],
        );
        let res = |id, outputs| ComputeResult {
            id,
            compute_us: 0,
            outputs,
        };
        assert_eq!(res(7, vec![vec![0.0; 16]]).check(&req), Ok(()));
        assert!(res(8, vec![vec![0.0; 16]]).check(&req).is_err());
        assert!(res(7, vec![vec![0.0; 15]]).check(&req).is_err());
        assert!(res(7, vec![]).check(&req).is_err());
    }

    #[test]
    fn oversized_frames_are_refused_before_reading() {
        assert!(matches!(
            frame_len(((MAX_FRAME + 1) as u32).to_le_bytes()),
            Err(WireError::TooLarge(_))
        ));
        assert!(decode(&[]).is_err());
    }

    proptest! {
        #[test]
        fn damaged_frames_never_panic(
            seed in proptest::collection::vec(any::<u8>(), 0..512),
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
            cut in any::<usize>(),
        ) {
            // arbitrary bytes
            let _ = decode(&seed);
            // a valid message, damaged
            let m = Message::Compute(request(2, 8, vec![Run { expert: 1, rows: vec![1, 0] }]));
            let mut f = encode(&m).unwrap().split_off(LEN_BYTES);
            for (at, x) in flips {
                let n = f.len();
                f[at % n] ^= x;
            }
            f.truncate(cut % (f.len() + 1));
            if let Ok(Message::Compute(r)) = decode(&f) {
                let _ = r.check(&LIMITS);
            }
        }
    }
}
