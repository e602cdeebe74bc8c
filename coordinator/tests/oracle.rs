//! Golden tests against `tests/data/oracle` (tensors computed by Hugging Face transformers in
//! float32; see its README). Floats by error norms, discrete decisions exactly.

use std::path::PathBuf;

use charm_coordinator::decode::generate::generate;
use charm_coordinator::decode::sampling::{argmax, Sampler, SamplingParams};
use charm_coordinator::model::cache::KvCache;
use charm_coordinator::{ForwardOptions, MlaMode, Model, Trace};
use charm_shared::dtype::to_f32;
use charm_shared::safetensors::SafetensorsFile;

const FIXTURES: [&str; 5] = [
    "glm5-tiny",
    "glm5-tiny-grouped",
    "glm5-small-fp8",
    "deepseek3-tiny",
    "qwen3moe-tiny",
];

/// Largest |charm - transformers| logit difference accepted. An independent float32 implementation
/// (llama.cpp's CPU path) lands between 2e-6 and 6e-5 on these shapes.
const LOGIT_TOL: f32 = 5e-5;
const HIDDEN_TOL: f32 = 5e-5;
const WEIGHT_TOL: f32 = 1e-5;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/oracle")
        .join(name)
}

struct Oracle(SafetensorsFile);

impl Oracle {
    fn open(name: &str) -> Self {
        Oracle(SafetensorsFile::open(&dir(name).join("oracle.safetensors")).unwrap())
    }
    fn has(&self, n: &str) -> bool {
        self.0.header.tensors.contains_key(n)
    }
    fn shape(&self, n: &str) -> Vec<usize> {
        self.0.header.tensors[n].shape.clone()
    }
    fn f32(&self, n: &str) -> Vec<f32> {
        to_f32(self.0.header.tensors[n].dtype, self.0.bytes(n).unwrap()).unwrap()
    }
    fn ints(&self, n: &str) -> Vec<i64> {
        self.0.ints(n).unwrap()
    }
    fn ids(&self, n: &str) -> Vec<u32> {
        self.ints(n).into_iter().map(|x| x as u32).collect()
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Asserts two runs' logits (`[positions, vocab]`) are equal bit for bit.
fn same_bits(a: &[f32], b: &[f32], vocab: usize, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let differ = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits());
    assert!(
        differ.is_none(),
        "{what} differ first at position {} (max diff {})",
        differ.unwrap_or(0) / vocab,
        max_abs_diff(a, b)
    );
}

fn argmaxes(l: &[f32], vocab: usize) -> Vec<usize> {
    l.chunks(vocab).map(argmax).collect()
}

/// One teacher-forced pass: logits, argmax, per-layer outputs, router choices and weights, DSA.
fn teacher_forced(name: &str, mode: MlaMode) {
    let m = Model::load(&dir(name)).unwrap();
    let o = Oracle::open(name);
    let ids = o.ids("tf_input_ids");
    let (s, v, h) = (ids.len(), m.spec.vocab_size, m.spec.hidden_size);
    let mut cache = KvCache::new(&m.spec);
    let mut tr = Trace::default();
    let normed = m
        .forward(
            &ids,
            &mut cache,
            ForwardOptions { mla: mode },
            Some(&mut tr),
        )
        .unwrap();
    let logits = m.logits(&normed, s).unwrap();
    let want = o.f32("tf_logits");
    let d = max_abs_diff(&logits, &want);
    eprintln!("{name} {mode:?}: max logit diff {d:e}");
    assert!(d < LOGIT_TOL, "{name} {mode:?}: logits differ by {d}");
    assert_eq!(
        argmaxes(&logits, v),
        argmaxes(&want, v),
        "{name} {mode:?}: argmax"
    );

    let lo = o.f32("tf_layer_out");
    assert_eq!(tr.layer_out.len(), m.spec.layers.len());
    for (l, got) in tr.layer_out.iter().enumerate() {
        let d = max_abs_diff(got, &lo[l * s * h..(l + 1) * s * h]);
        assert!(
            d < HIDDEN_TOL,
            "{name} {mode:?}: layer {l} output differs by {d}"
        );
    }
    let d = max_abs_diff(&normed, &o.f32("tf_final_normed"));
    assert!(d < HIDDEN_TOL, "{name}: final norm differs by {d}");

    let experts = o.ints("tf_router_experts");
    let weights = o.f32("tf_router_weights");
    let k = o.shape("tf_router_experts")[2];
    assert_eq!(
        tr.router.len(),
        o.shape("tf_router_experts")[0],
        "{name}: MoE layer count"
    );
    for (l, layer) in tr.router.iter().enumerate() {
        assert_eq!(layer.len(), s, "{name}: router layer {l} token count");
        for (t, (ids, ws)) in layer.iter().enumerate() {
            assert_eq!(
                (ids.len(), ws.len()),
                (k, k),
                "{name}: router layer {l} token {t}: experts and weights"
            );
            let mut pairs: Vec<(u32, f32)> = ids.iter().copied().zip(ws.iter().copied()).collect();
            pairs.sort_by_key(|p| p.0);
            let base = (l * s + t) * k;
            let want_ids: Vec<u32> = experts[base..base + k].iter().map(|&x| x as u32).collect();
            let got_ids: Vec<u32> = pairs.iter().map(|p| p.0).collect();
            assert_eq!(got_ids, want_ids, "{name}: router layer {l} token {t}");
            for (j, p) in pairs.iter().enumerate() {
                let d = (p.1 - weights[base + j]).abs();
                assert!(
                    d < WEIGHT_TOL,
                    "{name}: gate weight layer {l} token {t} differs by {d}"
                );
            }
        }
    }

    if o.has("tf_dsa_selected") {
        let masks = o.ints("tf_dsa_selected");
        assert_eq!(
            tr.dsa.len(),
            o.shape("tf_dsa_selected")[0],
            "{name}: full indexer layer count"
        );
        for (l, sel) in tr.dsa.iter().enumerate() {
            assert_eq!(sel.len(), s, "{name}: DSA layer {l} query count");
            for (i, keys) in sel.iter().enumerate() {
                let want: Vec<u32> = (0..s as u32)
                    .filter(|&j| masks[(l * s + i) * s + j as usize] == 1)
                    .collect();
                assert_eq!(keys, &want, "{name}: DSA layer {l} query {i}");
            }
        }
    } else {
        assert!(tr.dsa.is_empty());
    }
}

#[test]
fn teacher_forced_naive_matches_transformers() {
    for f in FIXTURES {
        teacher_forced(f, MlaMode::Naive);
    }
}

#[test]
fn teacher_forced_absorbed_matches_transformers() {
    for f in FIXTURES {
        teacher_forced(f, MlaMode::Absorbed);
        teacher_forced(f, MlaMode::AbsorbedSplit);
    }
}

/// Absorbed MLA in the layout of a step of many queries (`kv_b` read once for all of them) gives
/// every query the bits it gets alone: a one-pass forward split that way equals one-token
/// decode steps (each query's heads from query to output in one unit), position by position.
#[test]
fn split_absorbed_attention_equals_one_query_at_a_time() {
    for f in [
        "glm5-tiny",
        "glm5-tiny-grouped",
        "glm5-small-fp8",
        "deepseek3-tiny",
    ] {
        let m = Model::load(&dir(f)).unwrap();
        let ids = Oracle::open(f).ids("tf_input_ids");
        let (s, v) = (ids.len(), m.spec.vocab_size);
        let split = ForwardOptions {
            mla: MlaMode::AbsorbedSplit,
        };
        let mut c1 = KvCache::new(&m.spec);
        let one = m
            .logits(&m.forward(&ids, &mut c1, split, None).unwrap(), s)
            .unwrap();
        let mut c2 = KvCache::new(&m.spec);
        let mut step = Vec::new();
        for t in 0..s {
            let n = m
                .forward(&ids[t..t + 1], &mut c2, ForwardOptions::default(), None)
                .unwrap();
            step.extend(m.logits(&n, 1).unwrap());
        }
        same_bits(
            &one,
            &step,
            v,
            &format!("{f}: split one-pass vs one query at a time"),
        );
    }
}

#[test]
fn greedy_decode_through_cache_matches_transformers() {
    for f in FIXTURES {
        let m = Model::load(&dir(f)).unwrap();
        let o = Oracle::open(f);
        let prompt = o.ids("greedy_prompt");
        let want = o.ids("greedy_ids");
        for mode in [MlaMode::Absorbed, MlaMode::Naive] {
            let g = generate(
                &m,
                &prompt,
                want.len(),
                &mut Sampler::new(SamplingParams::default()),
                &[],
                ForwardOptions { mla: mode },
            )
            .unwrap();
            assert_eq!(g.ids, want, "{f} {mode:?}: greedy ids");
        }
    }
}

/// Token-by-token decode through the cache gives the one-pass logits at every position, bit for
/// bit, with either MLA evaluation: the kernels compute each row with the same arithmetic
/// whatever the number of rows, and attention reads the same keys in the same order.
#[test]
fn cached_decode_equals_one_pass_at_every_position() {
    for f in FIXTURES {
        let m = Model::load(&dir(f)).unwrap();
        let o = Oracle::open(f);
        let ids = o.ids("tf_input_ids");
        let (s, v) = (ids.len(), m.spec.vocab_size);
        for mode in [MlaMode::Absorbed, MlaMode::Naive] {
            let opts = ForwardOptions { mla: mode };
            let mut c1 = KvCache::new(&m.spec);
            let one = m
                .logits(&m.forward(&ids, &mut c1, opts, None).unwrap(), s)
                .unwrap();
            let mut c2 = KvCache::new(&m.spec);
            // prefill a few tokens, then one at a time
            let split = 3;
            let mut step = m
                .logits(
                    &m.forward(&ids[..split], &mut c2, opts, None).unwrap(),
                    split,
                )
                .unwrap();
            for t in split..s {
                let n = m.forward(&ids[t..t + 1], &mut c2, opts, None).unwrap();
                step.extend(m.logits(&n, 1).unwrap());
            }
            assert_eq!(c2.len(), s);
            assert_eq!(one.len(), step.len(), "{f} {mode:?}");
            same_bits(
                &one,
                &step,
                v,
                &format!("{f} {mode:?}: cached vs one-pass logits"),
            );
            assert_eq!(argmaxes(&one, v), argmaxes(&step, v), "{f} {mode:?}");
        }
    }
}

/// Absorbed MLA (query absorbs kv_b, values projected after attention) equals the naive expansion.
#[test]
fn absorbed_mla_equals_naive() {
    for f in ["glm5-tiny", "deepseek3-tiny", "glm5-small-fp8"] {
        let m = Model::load(&dir(f)).unwrap();
        let ids = Oracle::open(f).ids("tf_input_ids");
        let run = |mode| {
            let mut c = KvCache::new(&m.spec);
            let mut tr = Trace::default();
            m.forward(&ids, &mut c, ForwardOptions { mla: mode }, Some(&mut tr))
                .unwrap();
            tr
        };
        let (a, b) = (run(MlaMode::Absorbed), run(MlaMode::Naive));
        assert_eq!(
            a.layer_out.len(),
            m.spec.layers.len(),
            "{f}: absorbed layers"
        );
        assert_eq!(b.layer_out.len(), m.spec.layers.len(), "{f}: naive layers");
        for (l, (x, y)) in a.layer_out.iter().zip(&b.layer_out).enumerate() {
            let d = max_abs_diff(x, y);
            assert!(d < 1e-5, "{f}: layer {l} absorbed vs naive differ by {d}");
        }
        assert_eq!(
            a.router
                .iter()
                .map(|l| l.iter().map(|r| r.0.clone()).collect::<Vec<_>>())
                .collect::<Vec<_>>(),
            b.router
                .iter()
                .map(|l| l.iter().map(|r| r.0.clone()).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn mtp_draft_logits_match_reference() {
    let m = Model::load(&dir("glm5-tiny")).unwrap();
    assert!(m.mtp.is_some(), "glm5-tiny carries one MTP layer");
    let o = Oracle::open("glm5-tiny");
    let ids = o.ids("tf_input_ids");
    let (s, h, v) = (ids.len(), m.spec.hidden_size, m.spec.vocab_size);
    let mut c = KvCache::new(&m.spec);
    let normed = m
        .forward(&ids, &mut c, ForwardOptions::default(), None)
        .unwrap();
    let mut mc = KvCache::with_layers(&m.spec, 1);
    let draft = m
        .mtp_forward(&ids[1..], &normed[..(s - 1) * h], &mut mc)
        .unwrap();
    let want = o.f32("mtp_logits");
    let d = max_abs_diff(&draft, &want);
    eprintln!("mtp: max logit diff {d:e}");
    assert!(d < LOGIT_TOL, "MTP logits differ by {d}");
    assert_eq!(argmaxes(&draft, v), argmaxes(&want, v));
}

#[test]
fn main_model_ignores_mtp_tensors() {
    // The MTP layer's tensors are loaded apart and never run by the main forward: the main
    // logits above match the oracle, and the layer count is the config's.
    let m = Model::load(&dir("glm5-tiny")).unwrap();
    assert_eq!(m.layers.len(), 4);
    assert_eq!(m.mtp.as_ref().unwrap().layer.index, 4);
}

/// Several sequences in one batched step (a prefill joining two running decodes, at different
/// depths) give each sequence exactly the logits it gets alone, and the reference's.
#[test]
fn batched_sequences_equal_each_alone_and_the_reference() {
    use charm_coordinator::model::forward::Step;
    for f in FIXTURES {
        let m = Model::load(&dir(f)).unwrap();
        let o = Oracle::open(f);
        let ids = o.ids("tf_input_ids");
        let (s, v) = (ids.len(), m.spec.vocab_size);
        let h = m.spec.hidden_size;
        let other: Vec<u32> = (0..s as u32).map(|i| (i * 7 + 3) % v as u32).collect();
        let opts = ForwardOptions::default();
        // alone: each sequence prefilled in two chunks then decoded one token at a time
        let alone = |toks: &[u32], split: usize| {
            let mut c = KvCache::new(&m.spec);
            let mut l = m
                .logits(
                    &m.forward(&toks[..split], &mut c, opts, None).unwrap(),
                    split,
                )
                .unwrap();
            for t in split..toks.len() {
                let n = m.forward(&toks[t..t + 1], &mut c, opts, None).unwrap();
                l.extend(m.logits(&n, 1).unwrap());
            }
            l
        };
        let (want_a, want_b) = (alone(&ids, 3), alone(&other, 5));
        let mut one_pass = KvCache::new(&m.spec);
        let want_c = m
            .logits(&m.forward(&ids, &mut one_pass, opts, None).unwrap(), s)
            .unwrap();
        // batched: A and B prefill together, then decode together; C (the whole prompt) joins
        // at A's fifth token
        let (mut ca, mut cb, mut cc) = (
            KvCache::new(&m.spec),
            KvCache::new(&m.spec),
            KvCache::new(&m.spec),
        );
        let (mut la, mut lb, mut lc) = (Vec::new(), Vec::new(), Vec::new());
        let mut steps = vec![
            Step {
                tokens: &ids[..3],
                cache: &mut ca,
            },
            Step {
                tokens: &other[..5],
                cache: &mut cb,
            },
        ];
        let x = m.forward_batch(&mut steps, opts, None).unwrap();
        la.extend(m.logits(&x[..3 * h], 3).unwrap());
        lb.extend(m.logits(&x[3 * h..], 5).unwrap());
        for t in 3..s {
            let b = t + 2;
            let mut steps = vec![Step {
                tokens: &ids[t..t + 1],
                cache: &mut ca,
            }];
            if b < s {
                steps.push(Step {
                    tokens: &other[b..b + 1],
                    cache: &mut cb,
                });
            }
            let join = t == 4;
            if join {
                steps.push(Step {
                    tokens: &ids,
                    cache: &mut cc,
                });
            }
            let n_rows: usize = steps.iter().map(|st| st.tokens.len()).sum();
            let x = m.forward_batch(&mut steps, opts, None).unwrap();
            let l = m.logits(&x, n_rows).unwrap();
            la.extend_from_slice(&l[..v]);
            let mut at = v;
            if b < s {
                lb.extend_from_slice(&l[at..at + v]);
                at += v;
            }
            if join {
                lc.extend_from_slice(&l[at..]);
            }
        }
        assert_eq!(la, want_a, "{f}: sequence A batched vs alone");
        assert_eq!(lb, want_b, "{f}: sequence B batched vs alone");
        assert_eq!(lc, want_c, "{f}: sequence C batched vs alone");
        let d = max_abs_diff(&lc, &o.f32("tf_logits"));
        assert!(
            d < LOGIT_TOL,
            "{f}: batched logits differ from the reference by {d}"
        );
        assert_eq!(ca.len(), s);
        assert_eq!(cb.len(), s);
        assert_eq!(cc.len(), s);
    }
}
