//! A worker's shard fetched from its coordinator, record by record (see [`crate::shard`]).

use std::sync::Arc;
use std::time::Duration;

use charm_shared::wire::{Message, MAX_CHUNK};

use super::frame::{read_frame, write_frame};

/// Fetches the records of the experts placed on this worker that its shard lacks, one at a
/// time in chunks, from the coordinator at the other end of `conn`; prints its progress.
pub(super) async fn fetch_shard(
    conn: quinn::Connection,
    shard: Arc<crate::shard::Shard>,
    node: String,
    mut assigned: tokio::sync::watch::Receiver<Vec<(usize, u32)>>,
) {
    // a test hook: die (as a kill would) after storing this many records
    let abort_after: Option<usize> = std::env::var("CHARM_FETCH_ABORT_AFTER")
        .ok()
        .and_then(|v| v.parse().ok());
    let mut stored = 0usize;
    loop {
        let todo = shard.missing(&assigned.borrow_and_update());
        if todo.is_empty() {
            if assigned.changed().await.is_err() {
                return;
            }
            continue;
        }
        let bytes: u64 = todo
            .iter()
            .filter_map(|k| shard.layer(k.0).map(|l| l.record_bytes))
            .sum();
        eprintln!(
            "{node}: fetching {} expert records ({:.2} GB) of its shard from the coordinator",
            todo.len(),
            bytes as f64 / 1e9
        );
        let mut last = std::time::Instant::now();
        for (i, &(layer, expert)) in todo.iter().enumerate() {
            let rec = match fetch_record(&conn, &shard, layer, expert).await {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("{node}: fetching layer {layer} expert {expert}: {e}");
                    if conn.close_reason().is_some() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            };
            let s2 = shard.clone();
            let kept = tokio::task::spawn_blocking(move || s2.store(layer, expert, &rec)).await;
            match kept {
                Ok(Ok(())) => stored += 1,
                Ok(Err(e)) => {
                    eprintln!("{node}: layer {layer} expert {expert} not kept: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
                Err(e) => {
                    eprintln!("{node}: {e}");
                    return;
                }
            }
            if abort_after.is_some_and(|n| stored >= n) {
                std::process::abort();
            }
            if last.elapsed() > Duration::from_secs(2) || i + 1 == todo.len() {
                eprintln!(
                    "{node}: {}/{} records fetched ({} held)",
                    i + 1,
                    todo.len(),
                    shard.held()
                );
                last = std::time::Instant::now();
            }
        }
    }
}

/// One expert record from the coordinator, in chunks of at most [`MAX_CHUNK`].
async fn fetch_record(
    conn: &quinn::Connection,
    shard: &crate::shard::Shard,
    layer: usize,
    expert: u32,
) -> Result<Vec<u8>, String> {
    let total = shard
        .layer(layer)
        .ok_or_else(|| format!("layer {layer} has no experts"))?
        .record_bytes;
    let mut rec = Vec::with_capacity(total as usize);
    while (rec.len() as u64) < total {
        let offset = rec.len() as u64;
        let len = (total - offset).min(MAX_CHUNK as u64) as u32;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let ask = Message::Fetch {
            layer: layer as u32,
            expert,
            offset,
            len,
        };
        write_frame(&mut send, &ask)
            .await
            .map_err(|e| e.to_string())?;
        match read_frame(&mut recv).await.map_err(|e| e.to_string())?.0 {
            Message::Chunk {
                layer: l,
                expert: e,
                offset: o,
                data,
            } if l as usize == layer
                && e == expert
                && o == offset
                && data.len() == len as usize =>
            {
                rec.extend_from_slice(&data)
            }
            Message::Failed { message, .. } => return Err(message),
            _ => return Err("the coordinator answered a fetch with something else".into()),
        }
    }
    Ok(rec)
}
