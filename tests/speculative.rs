//! Speculative decoding gives exactly plain decoding's tokens: greedy and sampled, with MTP and
//! prompt-lookup drafts, fixed and adaptive draft counts, on every oracle fixture and the demo
//! model (f32 and int8 activations), with experts streamed from disk; and a rejected draft at
//! any position leaves the caches as if it had never been drafted.

mod common;

use std::path::{Path, PathBuf};

use charm_coordinator::decode::generate::{generate, generate_with_drafts};
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::decode::speculative::{verify_step, DraftOptions, DraftSource};
use charm_coordinator::model::cache::KvCache;
use charm_coordinator::{Engine, EngineOptions, ForwardOptions, Model};
use charm_shared::quant::Activations;
use common::{charm, fixture, plan, scratch, FIXTURES};
use serde_json::Value;

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/charm-bard-moe")
}

fn load(dir: &Path, activations: Activations) -> Engine {
    Engine::load(
        dir,
        &EngineOptions {
            activations,
            ..Default::default()
        },
    )
    .unwrap()
}

fn plain(m: &Model, prompt: &[u32], n: usize, p: SamplingParams) -> Vec<u32> {
    let g = generate(
        m,
        prompt,
        n,
        &mut Sampler::new(p),
        &[],
        ForwardOptions::default(),
    );
    g.unwrap().ids
}

fn drafted(m: &Model, prompt: &[u32], n: usize, p: SamplingParams, d: DraftOptions) -> Vec<u32> {
    let mut s = Sampler::new(p);
    let g = generate_with_drafts(m, prompt, n, &mut s, &[], ForwardOptions::default(), d);
    let g = g.unwrap();
    let st = g.speculation.as_ref().expect("speculation ran");
    assert!(st.steps > 0 && st.accepted <= st.drafted);
    g.ids
}

/// Every way of drafting this test suite checks.
fn ways(has_mtp: bool) -> Vec<DraftOptions> {
    let mut out = Vec::new();
    let sources: &[DraftSource] = if has_mtp {
        &[DraftSource::Auto, DraftSource::Mtp, DraftSource::Lookup]
    } else {
        &[DraftSource::Lookup]
    };
    for &source in sources {
        for (max, adaptive) in [(1, false), (2, false), (4, false), (4, true)] {
            out.push(DraftOptions {
                max,
                source,
                adaptive,
            });
        }
    }
    out
}

fn greedy() -> SamplingParams {
    SamplingParams::default()
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed,
        ..Default::default()
    }
}

#[test]
fn drafts_give_the_plain_tokens_on_every_oracle_fixture() {
    for name in FIXTURES {
        let e = load(&fixture(name), Activations::F32);
        let m = &e.model;
        let v = m.spec.vocab_size as u32;
        // a prompt that repeats itself, so that prompt lookup has something to propose
        let prompt: Vec<u32> = (0..24u32).map(|i| (i % 6) * 7 % v + 1).collect();
        for p in [greedy(), sampled(3)] {
            let want = plain(m, &prompt, 40, p);
            for d in ways(m.mtp.is_some()) {
                assert_eq!(drafted(m, &prompt, 40, p, d), want, "{name} {d:?} {p:?}");
            }
        }
    }
}

#[test]
fn drafts_give_the_plain_tokens_on_the_demo_model_for_300_tokens() {
    let prompt: Vec<u32> = vec![5, 17, 3, 99, 250, 7, 1, 42, 300, 12];
    for act in [Activations::F32, Activations::Int8] {
        let e = load(&demo(), act);
        let m = &e.model;
        assert!(m.mtp.is_some(), "the demo model has an MTP layer");
        for p in [greedy(), sampled(7)] {
            let want = plain(m, &prompt, 300, p);
            for d in ways(true) {
                assert_eq!(drafted(m, &prompt, 300, p, d), want, "{act:?} {d:?} {p:?}");
            }
        }
    }
}

/// The demo model's greedy continuation drafted with a wrong token at position `r`: the step
/// keeps exactly the `r` right ones, the cache holds exactly the kept tokens, and decoding on from
/// there gives the plain tokens.
#[test]
fn a_rejected_draft_at_any_position_rolls_the_cache_back() {
    let e = load(&demo(), Activations::F32);
    let m = &e.model;
    let prompt: Vec<u32> = vec![5, 17, 3, 99, 250, 7, 1, 42];
    let want = plain(m, &prompt, 24, greedy());
    let opts = ForwardOptions::default();
    let k = 6;
    for r in 0..=k {
        let mut cache = KvCache::new(&m.spec);
        let normed = m.forward(&prompt, &mut cache, opts, None).unwrap();
        let h = m.spec.hidden_size;
        let mut s = Sampler::new(greedy());
        let next = s.sample(&m.logits(&normed[(prompt.len() - 1) * h..], 1).unwrap());
        assert_eq!(next, want[0]);
        // the true continuation, wrong from position r on (r == k: all right)
        let mut drafts = want[1..=k].to_vec();
        if r < k {
            drafts[r] = (drafts[r] + 1) % m.spec.vocab_size as u32;
        }
        let (got, states) = verify_step(m, &mut cache, &s, next, &drafts, opts).unwrap();
        assert_eq!(got.accepted, want[1..=r].to_vec(), "reject at {r}");
        assert_eq!(got.next, want[r + 1], "reject at {r}");
        assert_eq!(cache.len(), prompt.len() + 1 + r, "reject at {r}");
        assert_eq!(states.len(), (1 + r) * h);
        s.advance(1 + r as u64);
        // decode on one token at a time from the rolled-back cache
        let mut ids = vec![next];
        ids.extend(&got.accepted);
        let mut t = got.next;
        while ids.len() < want.len() {
            ids.push(t);
            let normed = m.forward(&[t], &mut cache, opts, None).unwrap();
            t = s.sample(&m.logits(&normed, 1).unwrap());
        }
        assert_eq!(ids, want, "reject at {r}");
    }
}

/// The demo model as a container (every expert in its own record), so a small RAM budget
/// streams experts from disk.
#[test]
fn drafts_give_the_plain_tokens_with_experts_streamed_from_disk() {
    let dir = scratch("spec-stream");
    let (ok, _, err) = charm(&[
        "convert",
        "--model",
        demo().to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let run = |draft: &str, ram: Option<&str>| -> Value {
        let mut args = vec![
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--ids",
            "5,17,3,99,250,7,1,42,300,12",
            "--max-tokens",
            "120",
            "--json",
            "--history",
            "none",
            "--draft",
            draft,
        ];
        if let Some(r) = ram {
            args.extend(["--ram", r]);
        }
        let (ok, out, err) = charm(&args);
        assert!(ok, "{err}");
        serde_json::from_str(out.trim()).unwrap()
    };
    let resident = run("0", None);
    // the plan's resident part at this context plus 16 of the 128 experts: the rest streams
    let p = plan(&dir, 130);
    let budget = p["resident_bytes"].as_u64().unwrap() + 16 * p["expert_bytes"].as_u64().unwrap();
    let gib = format!("{}", budget as f64 / (1u64 << 30) as f64);
    for draft in ["0", "3"] {
        let s = run(draft, Some(&gib));
        assert_eq!(s["ids"], resident["ids"], "--draft {draft}");
        assert!(
            s["stats"]["experts"]["misses"].as_u64().unwrap() > 0,
            "experts streamed: {s}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// glm5-tiny's MTP layer has random weights: its drafts are almost never accepted, and the output
/// is still the plain one.
#[test]
fn a_random_weight_mtp_head_is_rejected_and_changes_nothing() {
    let e = load(&fixture("glm5-tiny"), Activations::F32);
    let m = &e.model;
    let prompt: Vec<u32> = vec![1, 8, 15, 22, 29, 36, 1, 8, 15, 22];
    let want = plain(m, &prompt, 60, greedy());
    let d = DraftOptions {
        max: 3,
        source: DraftSource::Mtp,
        adaptive: false,
    };
    let mut s = Sampler::new(greedy());
    let g =
        generate_with_drafts(m, &prompt, 60, &mut s, &[], ForwardOptions::default(), d).unwrap();
    let st = g.speculation.unwrap();
    assert!(st.drafted > 100 && st.acceptance() < 0.05, "{st:?}");
    assert_eq!(g.ids, want);
}

/// Position-keyed sampling draws exactly from the filtered distribution: the first sampled token
/// of the demo model after a prompt, over 20,000 seeds, against the distribution computed here
/// (temperature 0.8, top-p 0.9), by a chi-square test at p = 0.001 (the seeds are fixed, so the
/// outcome is too).
#[test]
fn position_keyed_sampling_follows_the_filtered_distribution() {
    let e = load(&demo(), Activations::F32);
    let m = &e.model;
    let prompt: Vec<u32> = vec![5, 17, 3, 99, 250, 7, 1, 42, 300, 12];
    let mut cache = KvCache::new(&m.spec);
    let normed = m
        .forward(&prompt, &mut cache, ForwardOptions::default(), None)
        .unwrap();
    let h = m.spec.hidden_size;
    let logits = m.logits(&normed[(prompt.len() - 1) * h..], 1).unwrap();
    let (t, top_p) = (0.8f32, 0.9f32);
    // the filtered distribution, most likely first
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let mx = logits[idx[0]];
    let w: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i] - mx) / t) as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let (mut c, mut keep) = (0.0, w.len());
    for (i, x) in w.iter().enumerate() {
        c += x / total;
        if c >= top_p as f64 {
            keep = i + 1;
            break;
        }
    }
    let kept: f64 = w[..keep].iter().sum();
    let probs: Vec<f64> = w[..keep].iter().map(|x| x / kept).collect();
    assert!(
        keep >= 3,
        "a spread-out distribution to test: {keep} tokens"
    );
    let n = 20_000u64;
    let mut counts = vec![0u64; logits.len()];
    for seed in 0..n {
        let s = Sampler::new(SamplingParams {
            temperature: t,
            top_p,
            seed,
            ..Default::default()
        });
        // the number of a later position, as a verify step draws it
        counts[s.sample_at(&logits, 5) as usize] += 1;
    }
    let outside: u64 = (0..logits.len())
        .filter(|i| !idx[..keep].contains(i))
        .map(|i| counts[i])
        .sum();
    assert_eq!(outside, 0, "a token outside the top-p set was sampled");
    // bins of expected count >= 5, the rest pooled
    let (mut chi2, mut bins, mut rest_e, mut rest_o) = (0.0, 0usize, 0.0, 0.0);
    for (j, &p) in probs.iter().enumerate() {
        let (ex, ob) = (p * n as f64, counts[idx[j]] as f64);
        if ex >= 5.0 {
            chi2 += (ob - ex) * (ob - ex) / ex;
            bins += 1;
        } else {
            rest_e += ex;
            rest_o += ob;
        }
    }
    if rest_e > 0.0 {
        chi2 += (rest_o - rest_e) * (rest_o - rest_e) / rest_e;
        bins += 1;
    }
    let df = (bins - 1) as f64;
    // Wilson-Hilferty: the 0.999 quantile of chi-square with df degrees of freedom
    let z = 3.090;
    let crit = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    assert!(
        chi2 < crit,
        "chi-square {chi2:.1} over {df} degrees of freedom (limit {crit:.1})"
    );
}

/// With the MTP layer and prompt lookup beside it (`auto`), steps draft from both where the text
/// repeats itself (here a prompt that quotes its own continuation), and the tokens are still the
/// plain ones.
#[test]
fn prompt_lookup_beside_the_mtp_layer_drafts_and_changes_nothing() {
    let e = load(&demo(), Activations::F32);
    let m = &e.model;
    let base: Vec<u32> = vec![5, 17, 3, 99, 250, 7, 1, 42, 300, 12];
    let quoted = plain(m, &base, 30, greedy());
    let prompt: Vec<u32> = [&base[..], &quoted[..], &base[..]].concat();
    let mut seen = Vec::new();
    for p in [greedy(), sampled(5)] {
        let want = plain(m, &prompt, 80, p);
        let mut s = Sampler::new(p);
        let d = DraftOptions {
            max: 3,
            source: DraftSource::Auto,
            adaptive: false,
        };
        let g = generate_with_drafts(m, &prompt, 80, &mut s, &[], Default::default(), d);
        let g = g.unwrap();
        assert_eq!(g.ids, want, "{p:?}");
        let st = g.speculation.expect("speculation ran");
        assert!(st.lookup_accepted <= st.lookup_drafted && st.lookup_drafted <= st.drafted);
        seen.push((
            st.lookup_drafted,
            st.lookup_accepted,
            st.drafted,
            st.accepted,
        ));
    }
    eprintln!("(lookup drafted, accepted; all drafted, accepted): {seen:?}");
    assert!(seen.iter().all(|s| s.0 > 0), "prompt lookup never drafted");
    assert!(
        seen.iter().any(|s| s.2 > s.0),
        "the MTP layer never drafted"
    );
}
