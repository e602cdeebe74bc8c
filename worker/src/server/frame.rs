//! Frames ([`charm_shared::wire`]) read from and written to QUIC streams, and the transport
//! settings of cluster connections: the framing both cluster sides use.

use std::time::Duration;

use charm_shared::wire::{
    decode_payload, encode_payload, frame_len, receive, Message, Payload, Received, WireError,
    LEN_BYTES, MAX_FRAME,
};

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("stream: {0}")]
    Read(#[from] quinn::ReadExactError),
    #[error("stream: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("stream: {0}")]
    Closed(#[from] quinn::ClosedStream),
}

/// Reads one frame and decodes it (length checked before anything is allocated); returns the
/// message and the frame's size in bytes. For a stream that carries one frame: its end is
/// consumed when it came with the frame.
pub async fn read_frame(recv: &mut quinn::RecvStream) -> Result<(Message, usize), FrameError> {
    let m = read_message(recv).await?;
    read_fin(recv);
    Ok(m)
}

/// Reads the next frame of a stream that carries several: an error where the stream ends first.
pub async fn read_message(recv: &mut quinn::RecvStream) -> Result<(Message, usize), FrameError> {
    read_next(recv).await?.ok_or_else(ended)
}

/// A stream that ended where a frame was due.
fn ended() -> FrameError {
    FrameError::Read(quinn::ReadExactError::FinishedEarly(0))
}

/// Reads the next frame of a stream that carries several, or `None` where the stream ends
/// before one starts.
pub async fn read_next(
    recv: &mut quinn::RecvStream,
) -> Result<Option<(Message, usize)>, FrameError> {
    let Some(payload) = read_payload(recv).await? else {
        return Ok(None);
    };
    let n = LEN_BYTES + payload.len();
    Ok(Some((decode_payload(&payload)?, n)))
}

/// [`read_message`] (and for a stream that carries one frame, `last`, [`read_frame`]), a
/// computed result read in place ([`Received`]); returns the frame's size in bytes too.
pub async fn read_received(
    recv: &mut quinn::RecvStream,
    last: bool,
) -> Result<(Received, usize), FrameError> {
    let payload = read_payload(recv).await?.ok_or_else(ended)?;
    if last {
        read_fin(recv);
    }
    let n = LEN_BYTES + payload.len();
    Ok((receive(payload)?, n))
}

/// The next frame's payload of a stream that carries several (its length checked before
/// anything is allocated), or `None` where the stream ends before one starts.
async fn read_payload(recv: &mut quinn::RecvStream) -> Result<Option<Payload>, FrameError> {
    let mut prefix = [0u8; LEN_BYTES];
    match recv.read_exact(&mut prefix).await {
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        r => r?,
    }
    let n = frame_len(prefix)?;
    // the stream's received pieces copied once into an aligned buffer, which rkyv reads in
    // place
    let mut payload = Payload::with_capacity(n);
    while payload.len() < n {
        match recv
            .read_chunk(n - payload.len(), true)
            .await
            .map_err(quinn::ReadExactError::ReadError)?
        {
            Some(c) => payload.extend_from_slice(&c.bytes),
            None => return Err(quinn::ReadExactError::FinishedEarly(payload.len()).into()),
        }
    }
    Ok(Some(payload))
}

/// Consumes the end of `recv` when it has already arrived (the peer finishes each stream right
/// after its one frame, so the FIN comes with the last bytes), without waiting for it. A stream
/// dropped before its end is read is stopped with a STOP_SENDING frame: an extra packet, sent
/// on the request's critical path.
fn read_fin(recv: &mut quinn::RecvStream) {
    use std::future::Future;
    let mut probe = [0u8; 1];
    let read = std::pin::pin!(recv.read(&mut probe));
    let _ = read.poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
}

/// Ack-eliciting packets a peer of a cluster connection may receive before it must send an
/// ACK at once (QUIC's ACK-frequency extension; the default, 1, acknowledges every second
/// packet). A decode-sized message of up to this many packets is then acknowledged by the next
/// message the other way (or after [`ACK_DELAY`]) instead of by an ACK-only packet sent on the
/// receiver's critical path before it reads. Kept under half the initial congestion window (10
/// packets), which request-and-answer traffic seldom grows: a sender must never wait for
/// acknowledgements the receiver is holding back.
const ACK_EVERY: u32 = 4;

/// The longest a peer may hold back an acknowledgement (QUIC's default is 25 ms).
const ACK_DELAY: Duration = Duration::from_millis(1);

/// QUIC transport settings of cluster connections: keep-alives every `heartbeat`, a connection
/// given up after 4 heartbeats (at least 2 s) of silence, flow-control windows sized for a
/// prefill step's activations, at most 32 streams open at once per peer (and no one-way ones),
/// acknowledgements delayed ([`ACK_EVERY`], [`ACK_DELAY`]).
pub fn transport(heartbeat: Duration) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let idle = (heartbeat * 4).max(Duration::from_secs(2));
    t.keep_alive_interval(Some(heartbeat));
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(idle).expect("idle timeout fits"),
    ));
    // a peer gets few streams at once: each may hold a frame of up to MAX_FRAME in memory
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(32));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
    t.stream_receive_window(quinn::VarInt::from_u32(MAX_FRAME as u32 / 2));
    t.receive_window(quinn::VarInt::from_u32(MAX_FRAME as u32));
    t.send_window(MAX_FRAME as u64);
    let mut ack = quinn::AckFrequencyConfig::default();
    ack.ack_eliciting_threshold(quinn::VarInt::from_u32(ACK_EVERY))
        .max_ack_delay(Some(ACK_DELAY));
    t.ack_frequency_config(Some(ack));
    t
}

/// Writes one frame and finishes the stream's sending side.
pub async fn write_frame(send: &mut quinn::SendStream, m: &Message) -> Result<(), FrameError> {
    write_message(send, m).await?;
    send.finish()?;
    Ok(())
}

/// Writes one frame of a stream that carries several.
pub async fn write_message(send: &mut quinn::SendStream, m: &Message) -> Result<(), FrameError> {
    write_payload(send, encode_payload(m)?).await?;
    Ok(())
}

/// Writes a frame of `payload` ([`encode_payload`]): its length, then the payload handed to the
/// stream as it is, not copied into the stream's buffer. Returns the frame's size in bytes.
pub async fn write_payload(
    send: &mut quinn::SendStream,
    payload: Payload,
) -> Result<usize, FrameError> {
    let n = payload.len();
    if n > MAX_FRAME {
        return Err(WireError::TooLarge(n).into());
    }
    let prefix = bytes::Bytes::copy_from_slice(&(n as u32).to_le_bytes());
    send.write_all_chunks(&mut [prefix, bytes::Bytes::from_owner(payload)])
        .await?;
    Ok(LEN_BYTES + n)
}
