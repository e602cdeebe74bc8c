//! One MoE layer's expert work across the cluster: runs assigned to live holders, one request
//! per worker, a second wave on other holders for what failed, the rest on this machine, and the
//! answers combined in ascending expert order.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use charm_shared::expert::{combine, run_rows, ExpertBatch, ExpertError};
use charm_shared::wire::{ComputeRequest, ResultView, Run};

use super::inner::Inner;
use super::link::{request, Answer, Sent};
use crate::cluster::{spread, Placement};

/// A layer's batch with owned buffers, for the task that serves it.
pub(super) struct OwnedBatch {
    pub(super) step: u64,
    pub(super) layer: usize,
    pub(super) x: Vec<f32>,
    pub(super) n_tokens: usize,
    pub(super) ids: Vec<u32>,
    pub(super) weights: Vec<f32>,
    pub(super) top_k: usize,
}

impl OwnedBatch {
    pub(super) fn new(b: &ExpertBatch<'_>) -> Self {
        Self {
            step: b.step,
            layer: b.layer,
            x: b.x.to_vec(),
            n_tokens: b.n_tokens,
            ids: b.ids.to_vec(),
            weights: b.weights.to_vec(),
            top_k: b.top_k,
        }
    }
    pub(super) fn batch(&self) -> ExpertBatch<'_> {
        ExpertBatch {
            step: self.step,
            layer: self.layer,
            x: &self.x,
            n_tokens: self.n_tokens,
            ids: &self.ids,
            weights: &self.weights,
            top_k: self.top_k,
        }
    }
}

/// Per worker, the runs (indices into the layer's runs) it is asked for.
pub(super) type Assignment = Vec<(usize, Vec<usize>)>;

/// Spreads `todo` runs over live holders ([`spread`]: the fewest holders first, each to the
/// one that would finish it first by its measured speed), skipping `avoid`: per worker,
/// ascending, its runs ascending; the rest is returned for local compute.
pub(super) fn assign(
    p: &Placement,
    live: &[bool],
    avoid: &[usize],
    b: &ExpertBatch<'_>,
    runs: &[(u32, Vec<usize>)],
    todo: &[usize],
) -> (Assignment, Vec<usize>) {
    let holders: Vec<Vec<usize>> = todo
        .iter()
        .map(|&r| {
            p.holders(b.layer, runs[r].0)
                .iter()
                .copied()
                .filter(|&w| live[w] && !avoid.contains(&w))
                .collect()
        })
        .collect();
    let asked: Vec<(&[usize], usize)> = todo
        .iter()
        .zip(&holders)
        .map(|(&r, h)| (h.as_slice(), runs[r].1.len()))
        .collect();
    let mut out: Assignment = Vec::new();
    let mut local = Vec::new();
    let cost: Vec<f64> = (0..live.len()).map(|w| p.cost(w)).collect();
    for (&r, w) in todo.iter().zip(spread(&cost, &asked)) {
        match w {
            Some(w) => match out.iter_mut().find(|(x, _)| *x == w) {
                Some((_, v)) => v.push(r),
                None => out.push((w, vec![r])),
            },
            None => local.push(r),
        }
    }
    out.sort_unstable_by_key(|(w, _)| *w);
    for (_, v) in &mut out {
        v.sort_unstable();
    }
    local.sort_unstable();
    (out, local)
}

/// Consecutive token ranges of a batch of `n_tokens` whose requests to one worker each stay
/// within `bytes`: a token's activation row out and up to `top_k` result rows back, `hidden`
/// floats each (at least one token a range).
pub(super) fn token_ranges(
    n_tokens: usize,
    hidden: usize,
    top_k: usize,
    bytes: usize,
) -> Vec<Range<usize>> {
    let per = (hidden * 4 * (1 + top_k)).max(1);
    let n = (bytes / per).max(1);
    (0..n_tokens)
        .step_by(n)
        .map(|s| s..(s + n).min(n_tokens))
        .collect()
}

/// The request for the slots of `runs[idx]` whose tokens are in `tokens`, of batch `b`, and
/// the runs it carries (those with such slots, in its order) with the number of output values
/// each has in the answer: each token's row once, runs
/// ascending by expert; the rows as int8 codes in groups of `codes_group` where that is exact
/// (int8 activations, a worker whose experts all quantize them in such groups), else f32. A
/// run's slots are ascending, so its outputs from consecutive token ranges, joined in order,
/// are its outputs.
#[allow(clippy::too_many_arguments)]
pub(super) fn build_request(
    id: u64,
    b: &ExpertBatch<'_>,
    h: usize,
    activations: &str,
    codes_group: usize,
    runs: &[(u32, Vec<usize>)],
    idx: &[usize],
    tokens: Range<usize>,
) -> (ComputeRequest, Vec<(usize, usize)>) {
    let mut row_of: HashMap<usize, u32> = HashMap::new();
    let mut x = Vec::new();
    let mut out = Vec::with_capacity(idx.len());
    let mut carried = Vec::with_capacity(idx.len());
    for &r in idx {
        let (expert, slots) = &runs[r];
        let rows: Vec<u32> = slots
            .iter()
            .filter(|&&s| tokens.contains(&(s / b.top_k)))
            .map(|&s| {
                let t = s / b.top_k;
                *row_of.entry(t).or_insert_with(|| {
                    x.extend_from_slice(&b.x[t * h..(t + 1) * h]);
                    (x.len() / h - 1) as u32
                })
            })
            .collect();
        if rows.is_empty() {
            continue;
        }
        carried.push((r, rows.len() * h));
        out.push(Run {
            expert: *expert,
            rows,
        });
    }
    let coded = (activations == "int8" && codes_group > 0 && h.is_multiple_of(codes_group))
        .then(|| charm_shared::wire::ActCodes::encode(&x, codes_group))
        .flatten();
    let (x, group, codes, amax) = match coded {
        Some(c) => (vec![], codes_group as u32, c.codes, c.amax),
        None => (x, 0, vec![], vec![]),
    };
    let req = ComputeRequest {
        id,
        step: b.step,
        layer: b.layer as u32,
        hidden: h as u32,
        activations: activations.to_string(),
        x,
        group,
        codes,
        amax,
        runs: out,
    };
    (req, carried)
}

/// One run's unweighted outputs.
enum Out {
    /// These values of answer `.0`'s outputs (where its frame was read, not copied out).
    Answer(usize, Range<usize>),
    Here(Vec<f32>),
}

impl Out {
    fn rows<'a>(&'a self, answers: &'a [ResultView]) -> &'a [f32] {
        match self {
            Out::Answer(a, rows) => &answers[*a].out()[rows.clone()],
            Out::Here(v) => v,
        }
    }
}

/// Serves one layer: requests to workers, retries on other holders, the rest locally. `sent`
/// fires once the first wave's requests are written (or none goes out).
pub(super) async fn serve(
    self_: Arc<Inner>,
    owned: Arc<OwnedBatch>,
    runs: Arc<Vec<(u32, Vec<usize>)>>,
    mut sent: Option<tokio::sync::oneshot::Sender<()>>,
) -> Result<Vec<f32>, ExpertError> {
    let s = &self_.shared;
    let b = owned.batch();
    let h = self_.hidden;
    let p = s.placement.read().expect("placement lock").clone();
    // each run's outputs: rows of an answer, or computed here (or joined from the answers to a
    // long prefill's several requests)
    let mut outs: Vec<Option<Out>> = (0..runs.len()).map(|_| None).collect();
    let mut answers: Vec<ResultView> = Vec::new();
    let mut todo: Vec<usize> = (0..runs.len()).collect();
    let mut avoid: Vec<usize> = Vec::new();
    let mut local_jobs = Vec::new();
    // two waves: the preferred holders, then other live holders of what failed
    for _wave in 0..2 {
        let live: Vec<bool> = s.workers.iter().map(|w| w.conn().is_some()).collect();
        let (asked, local) = assign(&p, &live, &avoid, &b, &runs, &todo);
        if !local.is_empty() {
            self_
                .fallbacks
                .fetch_add(local.len() as u64, Ordering::Relaxed);
            let (l, o, r) = (self_.local.clone(), owned.clone(), runs.clone());
            local_jobs.push(tokio::task::spawn_blocking(move || {
                let rows = run_rows(&*l, &o.batch(), &r, &local, h)?;
                Ok::<_, ExpertError>(local.into_iter().zip(rows).collect::<Vec<_>>())
            }));
        }
        todo.clear();
        // the first wave's requests share it; none goes out: it fires when dropped below
        let gate = sent.take().map(Sent::new);
        let mut tasks = Vec::new();
        // one request per worker, or for a long prefill several of consecutive tokens, sent one
        // after another
        let ranges = token_ranges(b.n_tokens, h, b.top_k, s.opts.request_bytes);
        for (w, idx) in asked {
            let Some(conn) = s.workers[w].conn() else {
                todo.extend(idx);
                continue;
            };
            let codes_group = s.workers[w]
                .hello
                .lock()
                .expect("worker lock")
                .as_ref()
                .map_or(0, |h| h.act_group as usize);
            let parts: Vec<(ComputeRequest, Vec<(usize, usize)>)> = ranges
                .iter()
                .map(|tokens| {
                    build_request(
                        self_.next_id.fetch_add(1, Ordering::Relaxed),
                        &b,
                        h,
                        s.hello.activations.first().map_or("f32", |a| a.as_str()),
                        codes_group,
                        &runs,
                        &idx,
                        tokens.clone(),
                    )
                })
                .filter(|(_, carried)| !carried.is_empty())
                .collect();
            let s2 = s.clone();
            let mut mine = gate.clone();
            tasks.push((
                w,
                idx,
                tokio::spawn(async move {
                    let mut got = Vec::with_capacity(parts.len());
                    for (req, carried) in parts {
                        let a = request(
                            &s2.workers[w],
                            conn.clone(),
                            req,
                            s2.opts.deadline,
                            mine.take(),
                        )
                        .await;
                        match a {
                            Answer::Done(r) => got.push((carried, r)),
                            _ => return None,
                        }
                    }
                    Some(got)
                }),
            ));
        }
        // (this task's share: the starter waits only for the requests)
        drop(gate);
        for (w, idx, t) in tasks {
            match t.await {
                Ok(Some(got)) => {
                    for (carried, out) in got {
                        let mut at = 0;
                        for (i, n) in carried {
                            let rows = at..at + n;
                            outs[i] = Some(match outs[i].take() {
                                None => Out::Answer(answers.len(), rows),
                                // a later token range of the run: its rows follow
                                Some(Out::Here(mut v)) => {
                                    v.extend_from_slice(&out.out()[rows]);
                                    Out::Here(v)
                                }
                                Some(o) => Out::Here([o.rows(&answers), &out.out()[rows]].concat()),
                            });
                            at += n;
                        }
                        answers.push(out);
                    }
                }
                Ok(None) | Err(_) => {
                    avoid.push(w);
                    todo.extend(idx);
                }
            }
        }
        if todo.is_empty() {
            break;
        }
    }
    if !todo.is_empty() {
        // what the second wave could not place either
        self_
            .fallbacks
            .fetch_add(todo.len() as u64, Ordering::Relaxed);
        let (l, o, r) = (self_.local.clone(), owned.clone(), runs.clone());
        let rest = std::mem::take(&mut todo);
        local_jobs.push(tokio::task::spawn_blocking(move || {
            let rows = run_rows(&*l, &o.batch(), &r, &rest, h)?;
            Ok::<_, ExpertError>(rest.into_iter().zip(rows).collect::<Vec<_>>())
        }));
    }
    for j in local_jobs {
        let done = j
            .await
            .map_err(|e| ExpertError::Internal(format!("local expert task: {e}")))?
            .map_err(|e| match e {
                ExpertError::Unavailable { layer, expert, why } => ExpertError::Unavailable {
                    layer,
                    expert,
                    why: format!("{why}; {}", s.holders_of(layer, expert)),
                },
                e => e,
            })?;
        for (i, o) in done {
            outs[i] = Some(Out::Here(o));
        }
    }
    let outs: Vec<&[f32]> = outs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            o.as_ref()
                .map(|o| o.rows(&answers))
                .ok_or_else(|| ExpertError::Unavailable {
                    layer: b.layer,
                    expert: runs[i].0,
                    why: "no holder answered".into(),
                })
        })
        .collect::<Result<_, _>>()?;
    Ok(combine(&b, h, &runs, &outs))
}

#[cfg(test)]
mod tests {
    use super::{assign, token_ranges};
    use crate::cluster::{Capacity, Placement};
    use charm_shared::expert::ExpertBatch;

    #[test]
    fn assign_serves_single_holders_first_and_lists_each_workers_runs_ascending() {
        // no history: experts 0 and 1 (the hot half) on both workers, 2 on worker 0, 3 on 1
        let cap = Capacity {
            ram_bytes: 0,
            rate: 0.0,
            holds: vec![(3, vec![0, 1, 2, 3])],
        };
        let p = Placement::compute(
            &[(3, 4)],
            &[Some(cap.clone()), Some(cap)],
            &|_, _| 0,
            2,
            0.5,
        );
        assert_eq!((p.holders(3, 1), p.holders(3, 2)), (&[0, 1][..], &[0][..]));
        let b = ExpertBatch {
            step: 0,
            layer: 3,
            x: &[],
            n_tokens: 1,
            ids: &[],
            weights: &[],
            top_k: 2,
        };
        let runs = vec![(1, vec![0]), (2, vec![1])];
        // in expert order, expert 1 would take worker 0 and expert 2 wait behind it
        let (out, local) = assign(&p, &[true, true], &[], &b, &runs, &[0, 1]);
        assert_eq!((out, local), (vec![(0, vec![1]), (1, vec![0])], vec![]));
        // a worker down: its runs to the other holder, in ascending order
        let (out, local) = assign(&p, &[true, false], &[], &b, &runs, &[1, 0]);
        assert_eq!((out, local), (vec![(0, vec![0, 1])], vec![]));
        // one avoided: what only it holds is computed here
        let (out, local) = assign(&p, &[true, true], &[0], &b, &runs, &[0, 1]);
        assert_eq!((out, local), (vec![(1, vec![0])], vec![1]));
    }

    #[test]
    fn token_ranges_cover_the_batch_in_order_within_the_budget() {
        // 4 floats out and 2 x 4 back per token: 48 bytes
        assert_eq!(token_ranges(5, 4, 2, 100), vec![0..2, 2..4, 4..5]);
        assert_eq!(token_ranges(5, 4, 2, 48 * 5), vec![0..5]);
        // a budget under one token still moves one token a request
        assert_eq!(token_ranges(3, 4, 2, 1), vec![0..1, 1..2, 2..3]);
        assert!(token_ranges(0, 4, 2, 100).is_empty());
    }
}
