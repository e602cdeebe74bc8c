//! The KV cache. MLA layers keep only the compressed latent and the rope key
//! (`kv_lora_rank + qk_rope_head_dim` floats per token: 576 for GLM-5.2); GQA layers keep K and V;
//! DSA `full` layers also keep their indexer keys.

use charm_shared::aligned::AlignedVec;
use charm_shared::config::{AttentionSpec, IndexerKind, ModelSpec};

/// Cache of one decoder layer.
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    /// Per token: MLA `[latent (kv_lora_rank, normed), k_rope (roped)]`, or GQA `[k, v]`.
    pub kv: AlignedVec,
    /// Floats per token in `kv`.
    pub width: usize,
    /// Per token `[index_head_dim]` indexer keys (normed, roped); empty unless a `full` DSA layer.
    pub index_keys: AlignedVec,
}

impl LayerCache {
    pub fn len(&self) -> usize {
        self.kv.len().checked_div(self.width).unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.kv.is_empty()
    }
    /// Token `t`'s entry.
    pub fn entry(&self, t: usize) -> &[f32] {
        &self.kv[t * self.width..(t + 1) * self.width]
    }
}

/// The cache of one sequence: one [`LayerCache`] per decoder layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub layers: Vec<LayerCache>,
    /// Its copy in VRAM when the dense skeleton runs on a GPU (`--dense-device gpu`): a mirror of
    /// `layers`, never the only copy; a clone starts without one.
    pub device: crate::model::gpu::DeviceKv,
}

impl KvCache {
    /// An empty cache for the main model (`n_layers` layers).
    pub fn new(spec: &ModelSpec) -> Self {
        Self::with_layers(spec, spec.layers.len())
    }

    /// An empty cache with `n` layers shaped like the model's attention.
    pub fn with_layers(spec: &ModelSpec, n: usize) -> Self {
        let width = match &spec.attention {
            AttentionSpec::Mla(m) => m.cache_width(),
            AttentionSpec::Gqa(g) => 2 * g.n_kv_heads * g.head_dim,
        };
        Self {
            layers: (0..n)
                .map(|_| LayerCache {
                    width,
                    ..Default::default()
                })
                .collect(),
            device: Default::default(),
        }
    }

    /// Reserves room for `tokens` more tokens in every layer, so a sequence of known length
    /// never reallocates (no growth doubling past what the memory plan counted).
    pub fn reserve(&mut self, tokens: usize, spec: &ModelSpec) {
        let idx = spec.dsa.as_ref().map_or(0, |d| d.head_dim);
        for (i, l) in self.layers.iter_mut().enumerate() {
            l.kv.reserve_exact(tokens * l.width);
            if spec.layers.get(i).and_then(|s| s.indexer) == Some(IndexerKind::Full) {
                l.index_keys.reserve_exact(tokens * idx);
            }
        }
    }

    /// Keeps only the first `tokens` tokens (a shared prefix another sequence continues from).
    pub fn truncate(&mut self, tokens: usize) {
        let n = self.len();
        for l in &mut self.layers {
            let per_token_index = l.index_keys.len().checked_div(n).unwrap_or(0);
            l.kv.truncate(tokens * l.width);
            l.index_keys.truncate(tokens * per_token_index);
        }
        self.device.truncate(tokens);
    }

    /// Tokens cached so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of f32 state held.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| 4 * (l.kv.len() + l.index_keys.len()))
            .sum()
    }

    /// Floats per token this model caches across all layers (for planning).
    pub fn floats_per_token(spec: &ModelSpec) -> usize {
        let width = match &spec.attention {
            AttentionSpec::Mla(m) => m.cache_width(),
            AttentionSpec::Gqa(g) => 2 * g.n_kv_heads * g.head_dim,
        };
        let idx = spec.dsa.as_ref().map_or(0, |d| d.head_dim);
        spec.layers
            .iter()
            .map(|l| {
                width
                    + if l.indexer == Some(IndexerKind::Full) {
                        idx
                    } else {
                        0
                    }
            })
            .sum()
    }
}
