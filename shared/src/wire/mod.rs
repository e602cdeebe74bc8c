//! The cluster wire protocol: the typed messages a coordinator and its expert workers exchange,
//! their framing, and the checks every received message passes before anything uses it. No
//! sockets here: the transport (QUIC with mutual TLS) lives in the worker and the coordinator.
//!
//! A frame is a 4-byte little-endian payload length, then the payload: one [`Message`] archived
//! with rkyv. [`decode`] refuses a frame over [`MAX_FRAME`], validates the archive (bytecheck)
//! before reading it, and [`ComputeRequest::check`] / [`ComputeResult::check`] refuse shapes that
//! do not match the model or the request (those checks are in `check`). Messages carry numbers and byte arrays only: never code,
//! graphs, pointers or file paths.
//!
//! **Exactness.** A worker returns each routed expert's output rows unweighted; the coordinator
//! adds them with [`crate::expert::combine`] in ascending expert order, as single-box does, so the
//! result is bit-identical whatever the placement. This costs `top_k x hidden x 4` bytes per token
//! and MoE layer on the way back (192 KiB for GLM-5.2: 8 experts of 6144 floats, minus the slots a
//! coordinator computes itself), against `hidden x 4` per worker for partial sums computed on the
//! workers, which would change the order of the additions and so the bits.

mod check;

use rkyv::{Archive, Deserialize, Serialize};

/// Protocol version; a peer speaking another is refused at the handshake. Version 3: a result's
/// outputs are one array, run after run (version 2: an array per run). Since version 2 a stream
/// carries frames one after another, each request answered on it before the next is read, until
/// its sender finishes it (version 1: one request per stream).
pub const PROTOCOL_VERSION: u32 = 4;
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
        /// Which of the experts in its hello the worker holds in VRAM now: bit `j` of the
        /// concatenation, layer after layer, of its hello's `experts[l].ids` (word `j / 64`, bit
        /// `j % 64`); empty when it has no GPU.
        vram: Vec<u64>,
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

impl Message {
    /// About the bytes its archive takes (its arrays, and room for the rest).
    fn size_hint(&self) -> usize {
        let arrays = match self {
            Message::Compute(r) => {
                4 * (r.x.len() + r.amax.len())
                    + r.codes.len()
                    + r.runs.iter().map(|r| 16 + 4 * r.rows.len()).sum::<usize>()
            }
            Message::Computed(r) => 4 * r.out.len(),
            Message::Chunk { data, .. } => data.len(),
            _ => 0,
        };
        arrays + 256
    }
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
    /// Free disk space where its model lives, bytes (0: unknown).
    pub disk_free_bytes: u64,
    /// Expert rows the peer computed per second when it started (0: not measured).
    pub expert_rate: f64,
    /// The peer fetches the records of the experts placed on it that it lacks (it may then
    /// be given any expert; see [`Message::Assign`]).
    pub fetches: bool,
    /// With int8 activations: the group every expert of the peer quantizes activations in, so
    /// requests may carry [`ActCodes`] of that group (0: send f32).
    pub act_group: u32,
    /// VRAM the peer gives experts on its GPU, bytes (0: none), and the adapter as its driver
    /// names it.
    pub vram_bytes: u64,
    pub gpu: String,
}

impl Hello {
    /// The hello of a peer of this protocol version holding no experts (a coordinator).
    pub fn holding_nothing(node: &str, model: &str, activations: Vec<String>) -> Self {
        Self {
            version: PROTOCOL_VERSION,
            node: node.into(),
            model: model.into(),
            activations,
            experts: vec![],
            ram_bytes: 0,
            disk_free_bytes: 0,
            expert_rate: 0.0,
            fetches: false,
            act_group: 0,
            vram_bytes: 0,
            gpu: String::new(),
        }
    }
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
    /// `[tokens, hidden]` activations of the tokens some run needs, f32 (empty when they come
    /// as `codes`).
    pub x: Vec<f32>,
    /// Or the same activations as int8 codes per group of `group` ([`ActCodes`]): what the
    /// integer path would quantize them to, with each group's largest magnitude. 0: f32 in `x`.
    pub group: u32,
    pub codes: Vec<i8>,
    pub amax: Vec<f32>,
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
    /// Nanoseconds the worker spent computing (statistics only: the round trip less this is
    /// what the network and framing cost).
    pub compute_ns: u64,
    /// The unweighted expert outputs of every run of the request, in its order: per run
    /// `[rows, hidden]`, its rows in the order the run lists them (one array, so that the worker
    /// sends its compute's output as it is and the coordinator reads it into one buffer).
    pub out: Vec<f32>,
}

/// Activations as the int8 codes the integer path quantizes them to (`--activations int8`),
/// sent instead of f32 where that is exact: about 4x fewer request bytes.
///
/// Per group of `group` values: the codes and the group's largest magnitude `amax`. The
/// receiver rebuilds values whose quantization gives back the same codes and the same scale
/// (`amax / 127`): the value of largest code keeps `amax` (its sign from the code), the others
/// `code * scale` (capped at `amax`). [`ActCodes::encode`] checks that this holds for every
/// group (it can fail only for groups whose scale is subnormal) and gives `None` otherwise, so
/// the sender then sends f32 instead.
#[derive(Debug, Clone, PartialEq)]
pub struct ActCodes {
    pub codes: Vec<i8>,
    pub amax: Vec<f32>,
}

impl ActCodes {
    /// Codes of `x` in groups of `group` (which must divide its length), if rebuilding them
    /// is exact.
    pub fn encode(x: &[f32], group: usize) -> Option<Self> {
        if group == 0 || !x.len().is_multiple_of(group) {
            return None;
        }
        let mut codes = vec![0i8; x.len()];
        let mut amax = Vec::with_capacity(x.len() / group);
        for (xs, cs) in x.chunks(group).zip(codes.chunks_mut(group)) {
            crate::quant::quantize_activation_group(xs, cs);
            amax.push(xs.iter().fold(0.0f32, |a, v| a.max(v.abs())));
        }
        // the receiver's quantization of what it rebuilds must give these codes and scales
        let back = Self::rebuild(&codes, &amax, group);
        let mut again = vec![0i8; group];
        for ((bs, cs), &a) in back.chunks(group).zip(codes.chunks(group)).zip(&amax) {
            let d = crate::quant::quantize_activation_group(bs, &mut again);
            if again != cs || d.to_bits() != (a / 127.0).to_bits() {
                return None;
            }
        }
        Some(Self { codes, amax })
    }

    /// Values that quantize to `codes` with scales `amax / 127`, in groups of `group`.
    pub fn rebuild(codes: &[i8], amax: &[f32], group: usize) -> Vec<f32> {
        let mut x = vec![0.0f32; codes.len()];
        for ((xs, cs), &a) in x
            .chunks_mut(group.max(1))
            .zip(codes.chunks(group.max(1)))
            .zip(amax)
        {
            let d = a / 127.0;
            for (v, &c) in xs.iter_mut().zip(cs) {
                *v = (c as f32 * d).clamp(-a, a);
            }
            // the largest code carries the group's largest magnitude exactly
            if let Some((i, &c)) = cs
                .iter()
                .enumerate()
                .max_by_key(|(i, c)| (c.unsigned_abs(), std::cmp::Reverse(*i)))
            {
                xs[i] = if c < 0 { -a } else { a };
            }
        }
        x
    }
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
    let body = encode_payload(m)?;
    let mut f = Vec::with_capacity(LEN_BYTES + body.len());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(&body);
    Ok(f)
}

/// `m` archived: a frame's payload, which goes after its length prefix (`(len as u32)`, little
/// endian), refused over [`MAX_FRAME`].
pub fn encode_payload(m: &Message) -> Result<Payload, WireError> {
    // sized for the message at once rather than grown while it is written
    let body = rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(
        m,
        Payload::with_capacity(m.size_hint()),
    )
    .map_err(|e| WireError::Malformed(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(WireError::TooLarge(body.len()));
    }
    Ok(body)
}

/// The payload length a frame's prefix announces, refused past [`MAX_FRAME`].
pub fn frame_len(prefix: [u8; LEN_BYTES]) -> Result<usize, WireError> {
    let n = u32::from_le_bytes(prefix) as usize;
    if n > MAX_FRAME {
        return Err(WireError::TooLarge(n));
    }
    Ok(n)
}

/// A frame's payload as [`decode_payload`] reads it: aligned as rkyv reads archives in place.
pub type Payload = rkyv::util::AlignedVec<16>;

/// A message from a frame's payload, validated before it is read.
pub fn decode(payload: &[u8]) -> Result<Message, WireError> {
    if payload.len() > MAX_FRAME {
        return Err(WireError::TooLarge(payload.len()));
    }
    let mut aligned = Payload::with_capacity(payload.len());
    aligned.extend_from_slice(payload);
    decode_payload(&aligned)
}

/// [`decode`] of a payload already aligned (read into a [`Payload`]), without a copy.
pub fn decode_payload(payload: &Payload) -> Result<Message, WireError> {
    if payload.len() > MAX_FRAME {
        return Err(WireError::TooLarge(payload.len()));
    }
    rkyv::from_bytes::<Message, rkyv::rancor::Error>(payload)
        .map_err(|e| WireError::Malformed(e.to_string()))
}

impl ComputeRequest {
    /// Tokens carried.
    pub fn tokens(&self) -> usize {
        self.values() / (self.hidden as usize).max(1)
    }

    /// Activation values carried (floats or codes).
    fn values(&self) -> usize {
        if self.group > 0 {
            self.codes.len()
        } else {
            self.x.len()
        }
    }

    /// The `[tokens, hidden]` activations as f32: `x`, or rebuilt from the codes so that the
    /// integer path quantizes them to exactly those codes and scales again.
    pub fn activations_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        if self.group == 0 {
            return std::borrow::Cow::Borrowed(&self.x);
        }
        std::borrow::Cow::Owned(ActCodes::rebuild(
            &self.codes,
            &self.amax,
            self.group as usize,
        ))
    }
}

/// A frame's message as the coordinator reads it: a computed result's outputs stay in the
/// frame's payload, read where they are rather than copied out; any other message is decoded.
#[derive(Debug)]
pub enum Received {
    Computed(ResultView),
    Other(Message),
}

/// A [`ComputeResult`] read in place from its frame's payload (validated).
#[derive(Debug)]
pub struct ResultView {
    pub id: u64,
    pub compute_ns: u64,
    payload: Payload,
    /// Byte offset and count of the outputs in `payload`.
    at: usize,
    len: usize,
    /// The outputs copied out, where the payload's bytes cannot be read as this machine's
    /// floats (a big-endian machine).
    copied: Option<Vec<f32>>,
}

impl ResultView {
    /// The outputs, as [`ComputeResult::out`].
    pub fn out(&self) -> &[f32] {
        match &self.copied {
            Some(v) => v,
            None => floats(&self.payload[self.at..self.at + 4 * self.len])
                .expect("checked when received"),
        }
    }
}

/// `bytes` as the little-endian floats they hold, where that needs no copy.
#[cfg(target_endian = "little")]
fn floats(bytes: &[u8]) -> Option<&[f32]> {
    // SAFETY: every bit pattern is a valid f32, and this machine's floats are little-endian
    let (head, mid, tail) = unsafe { bytes.align_to::<f32>() };
    (head.is_empty() && tail.is_empty()).then_some(mid)
}

#[cfg(not(target_endian = "little"))]
fn floats(_: &[u8]) -> Option<&[f32]> {
    None
}

/// A frame's payload read as [`Received`]: validated like [`decode_payload`], a computed
/// result's outputs left in place.
pub fn receive(payload: Payload) -> Result<Received, WireError> {
    if payload.len() > MAX_FRAME {
        return Err(WireError::TooLarge(payload.len()));
    }
    let bad = |e: rkyv::rancor::Error| WireError::Malformed(e.to_string());
    let m = rkyv::access::<ArchivedMessage, rkyv::rancor::Error>(&payload).map_err(bad)?;
    let ArchivedMessage::Computed(r) = m else {
        return Ok(Received::Other(
            rkyv::deserialize::<Message, rkyv::rancor::Error>(m).map_err(bad)?,
        ));
    };
    let out = r.out.as_slice();
    let at = out.as_ptr() as usize - payload.as_ptr() as usize;
    let len = out.len();
    let copied = floats(&payload[at..at + 4 * len])
        .is_none()
        .then(|| out.iter().map(|v| v.to_native()).collect());
    let (id, compute_ns) = (r.id.to_native(), r.compute_ns.to_native());
    Ok(Received::Computed(ResultView {
        id,
        compute_ns,
        payload,
        at,
        len,
        copied,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(super) fn request(tokens: usize, hidden: usize, runs: Vec<Run>) -> ComputeRequest {
        ComputeRequest {
            id: 7,
            step: 3,
            layer: 2,
            hidden: hidden as u32,
            activations: "f32".into(),
            x: (0..tokens * hidden).map(|i| i as f32 * 0.5 - 1.0).collect(),
            group: 0,
            codes: vec![],
            amax: vec![],
            runs,
        }
    }

    pub(super) const LIMITS: Limits = Limits {
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
                compute_ns: 120_000,
                out: [vec![1.5; 16], vec![-0.0; 8]].concat(),
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
                disk_free_bytes: 1 << 40,
                expert_rate: 1e4,
                fetches: false,
                act_group: 64,
                vram_bytes: 20 << 30,
                gpu: "NVIDIA GeForce RTX 3090".into(),
            }),
            Message::Failed {
                id: 1,
                class: FailureClass::Unavailable,
                message: "x".into(),
            },
            Message::Ping { seq: 9 },
            Message::Pong {
                seq: 9,
                vram: vec![5, 0],
            },
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
    fn results_are_read_in_place_and_other_messages_decoded() {
        let r = ComputeResult {
            id: 4,
            compute_ns: 9,
            out: (0..40).map(|i| i as f32 * 0.5 - 3.0).collect(),
        };
        let payload = |m: &Message| encode_payload(m).unwrap();
        match receive(payload(&Message::Computed(r.clone()))).unwrap() {
            Received::Computed(v) => {
                assert_eq!((v.id, v.compute_ns, v.out()), (4, 9, &r.out[..]));
                let rows = vec![0, 1, 2, 3, 4];
                let req = request(5, 8, vec![Run { expert: 1, rows }]);
                assert_eq!(
                    v.check(&ComputeRequest {
                        id: 4,
                        ..req.clone()
                    }),
                    Ok(())
                );
                assert!(v.check(&req).is_err());
            }
            m => panic!("{m:?}"),
        }
        let failed = Message::Failed {
            id: 2,
            class: FailureClass::Internal,
            message: "x".into(),
        };
        match receive(payload(&failed)).unwrap() {
            Received::Other(m) => assert_eq!(m, failed),
            m => panic!("{m:?}"),
        }
        let whole = payload(&Message::Computed(r));
        let mut cut = Payload::new();
        cut.extend_from_slice(&whole[..whole.len() - 8]);
        assert!(receive(cut).is_err());
    }

    #[test]
    fn oversized_frames_are_refused_before_reading() {
        assert!(matches!(
            frame_len(((MAX_FRAME + 1) as u32).to_le_bytes()),
            Err(WireError::TooLarge(_))
        ));
        assert!(decode(&[]).is_err());
    }

    /// Codes and scales of `x` in groups of `g`, as the integer path computes them.
    pub(super) fn quantized(x: &[f32], g: usize) -> (Vec<i8>, Vec<u32>) {
        let mut codes = vec![0i8; x.len()];
        let scales = x
            .chunks(g)
            .zip(codes.chunks_mut(g))
            .map(|(xs, cs)| crate::quant::quantize_activation_group(xs, cs).to_bits())
            .collect();
        (codes, scales)
    }

    #[test]
    fn activation_codes_rebuild_to_the_same_quantization() {
        let g = 64;
        let mut cases: Vec<Vec<f32>> = vec![
            (0..256).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect(),
            vec![0.0; 128],
            (0..128)
                .map(|i| if i == 5 { -7.5 } else { 1e-3 * i as f32 })
                .collect(),
            // ties at the largest magnitude, NaN and infinities
            (0..64)
                .map(|i| if i % 2 == 0 { 2.0 } else { -2.0 })
                .collect(),
            (0..64)
                .map(|i| if i == 3 { f32::NAN } else { i as f32 })
                .collect(),
            (0..64)
                .map(|i| if i == 9 { f32::INFINITY } else { 1.0 })
                .collect(),
        ];
        // magnitudes across the range, normal scales
        for e in [-30i32, -10, 0, 10, 30] {
            cases.push(
                (0..64)
                    .map(|i| ((i as f32) * 1.3).cos() * 2f32.powi(e))
                    .collect(),
            );
        }
        for x in &cases {
            let c = ActCodes::encode(x, g).unwrap_or_else(|| panic!("not exact: {x:?}"));
            let back = ActCodes::rebuild(&c.codes, &c.amax, g);
            assert_eq!(quantized(&back, g), quantized(x, g), "{x:?}");
        }
        // a group whose scale is subnormal may not rebuild exactly: then encode says so
        let tiny: Vec<f32> = (0..64).map(|i| (i as f32) * 1e-41).collect();
        if let Some(c) = ActCodes::encode(&tiny, g) {
            let back = ActCodes::rebuild(&c.codes, &c.amax, g);
            assert_eq!(quantized(&back, g), quantized(&tiny, g));
        }
        assert!(ActCodes::encode(&[1.0; 10], 64).is_none());
    }

    proptest! {
        #[test]
        fn rebuilt_activations_give_the_integer_path_the_same_bits(
            x in proptest::collection::vec(proptest::num::f32::ANY, 128..=128),
        ) {
            // what the worker computes from codes against what the coordinator would from x,
            // through the integer kernel of this machine's ISA (encode checks with the scalar twin)
            use crate::quant::{active_isa, Activations, QMatrix, QuantKind};
            let w = crate::kernels::Matrix::new(
                4,
                128,
                (0..4 * 128).map(|i| ((i as f32) * 0.7).sin()).collect(),
            );
            let q = QMatrix::quantize(&w, QuantKind::Int8, 64).unwrap();
            if let Some(c) = ActCodes::encode(&x, 64) {
                let back = ActCodes::rebuild(&c.codes, &c.amax, 64);
                let y = |v: &[f32]| {
                    q.matmul_with(v, 1, active_isa(), Activations::Int8)
                        .iter()
                        .map(|f| f.to_bits())
                        .collect::<Vec<_>>()
                };
                prop_assert_eq!(y(&back), y(&x));
            }
        }

        #[test]
        fn ordinary_activations_always_encode(
            x in proptest::collection::vec(-1e4f32..1e4, 64..=64),
        ) {
            prop_assert!(ActCodes::encode(&x, 64).is_some());
        }

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
