//! How the rows of a batched forward step are laid out, and the DSA selection of their keys:
//! what the forward pass and its attention pieces both read.

/// DSA selection of the current query tokens: per token, ascending key positions.
pub(super) type Selection = Vec<Vec<u32>>;

/// Where each row of a batched step belongs: rows are the sequences' new tokens, one sequence
/// after another.
pub(super) struct Rows {
    /// Per sequence: its rows.
    pub(super) spans: Vec<std::ops::Range<usize>>,
    /// Per row: its sequence.
    pub(super) seq: Vec<usize>,
    /// Per row: its position in its sequence.
    pub(super) pos: Vec<usize>,
}

impl Rows {
    /// `lens[s]` new tokens after `cached[s]` cached ones, per sequence.
    pub(super) fn new(lens: &[usize], cached: &[usize]) -> Self {
        let (mut spans, mut seq, mut pos) = (Vec::new(), Vec::new(), Vec::new());
        for (s, (&n, &p0)) in lens.iter().zip(cached).enumerate() {
            spans.push(seq.len()..seq.len() + n);
            seq.extend(std::iter::repeat_n(s, n));
            pos.extend(p0..p0 + n);
        }
        Self { spans, seq, pos }
    }

    pub(super) fn n(&self) -> usize {
        self.seq.len()
    }
}
