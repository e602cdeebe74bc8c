//! How often the router picked each routed expert, per layer, since the model loaded: the
//! dashboard's heat map. Counted where the router runs, so it is the same for experts in RAM,
//! streamed from disk or computed by workers.

use std::sync::atomic::{AtomicU64, Ordering};

/// Picks per `(layer, expert)`, for every layer index up to the model's last (MTP included).
#[derive(Debug, Default)]
pub struct ExpertUse {
    n_experts: usize,
    counts: Vec<AtomicU64>,
}

impl ExpertUse {
    /// Counters for layers `0..layers` of `n_experts` experts each.
    pub fn new(layers: usize, n_experts: usize) -> Self {
        Self {
            n_experts,
            counts: (0..layers * n_experts).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Counts `ids`, the router's picks of one step at `layer` (ids out of range are ignored).
    pub fn add(&self, layer: usize, ids: &[u32]) {
        let base = layer * self.n_experts;
        for &id in ids {
            if (id as usize) < self.n_experts {
                if let Some(c) = self.counts.get(base + id as usize) {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// The counts of `layer`'s experts (empty for a layer out of range).
    pub fn layer(&self, layer: usize) -> Vec<u64> {
        let base = layer * self.n_experts;
        self.counts
            .get(base..base + self.n_experts)
            .map_or_else(Vec::new, |c| {
                c.iter().map(|x| x.load(Ordering::Relaxed)).collect()
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_are_counted_per_layer_and_expert() {
        let u = ExpertUse::new(3, 4);
        u.add(1, &[0, 3, 3]);
        u.add(2, &[1, 9]);
        u.add(7, &[1]);
        assert_eq!(u.layer(0), vec![0; 4]);
        assert_eq!(u.layer(1), vec![1, 0, 0, 2]);
        assert_eq!(u.layer(2), vec![0, 1, 0, 0]);
        assert!(u.layer(3).is_empty());
    }
}
