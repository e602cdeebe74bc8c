//! Preparing and measuring a model: `charm convert` (a Hugging Face checkpoint into a charm
//! container), `charm quality` (logits against a reference) and `charm evaluate` (held-out
//! perplexity and routing figures).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use charm_coordinator::decode::tokenizer::TextTokenizer;
use charm_coordinator::model::cache::KvCache;
use charm_coordinator::ops;
use charm_coordinator::ops::plan::human;
use charm_coordinator::ForwardOptions;
use charm_shared::quant::Activations;
use clap::Args;

use crate::common::{self, Act, FormatArgs, StoreArgs};

/// The flags of `charm convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub formats: FormatArgs,
}

/// `charm convert`: converts `--model` into a container at `--out`, with a progress bar;
/// resumes an interrupted conversion.
pub fn convert(a: &ConvertArgs) -> Result<()> {
    let (model, out) = (&a.model, &a.out);
    let policy = &a.formats.policy()?;
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}")
            .expect("valid template"),
    );
    let abort_after = std::env::var("CHARM_CONVERT_ABORT_AFTER_BYTES")
        .ok()
        .and_then(|v| v.parse().ok());
    let t = std::time::Instant::now();
    let r = ops::convert::convert(model, out, policy, abort_after, &mut |done, total, what| {
        bar.set_length(total);
        bar.set_position(done);
        bar.set_message(what.to_string());
    })?;
    bar.finish_and_clear();
    eprintln!(
        "converted {} -> {}: {} in {:.1}s ({} units written, {} reused from an earlier run)",
        model.display(),
        out.display(),
        human(r.output_bytes),
        t.elapsed().as_secs_f64(),
        r.units_written,
        r.units_reused
    );
    Ok(())
}

/// The flags of `charm quality`.
#[derive(Args, Debug)]
pub struct QualityArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub reference: PathBuf,
    #[arg(long, value_enum, default_value = "f32")]
    pub activations: Act,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// `charm quality`: top-1 agreement and KL divergence against the reference's logits.
pub fn quality(args: &QualityArgs) -> Result<()> {
    let (model, reference, json, store) = (&args.model, &args.reference, args.json, &args.store);
    let act: Activations = args.activations.into();
    let r = charm_shared::safetensors::SafetensorsFile::open(reference)?;
    let ids = token_ids(&r, "tf_input_ids").context("reading the reference")?;
    let li = r
        .header
        .tensors
        .get("tf_logits")
        .context("reference has no `tf_logits`")?;
    let want = charm_shared::dtype::to_f32(li.dtype, r.bytes("tf_logits").expect("present"))
        .context("tf_logits is not a float tensor")?;
    let e = common::load(model, store, ids.len(), act)?;
    let m = &e.model;
    if want.len() != ids.len() * m.spec.vocab_size {
        bail!(
            "tf_logits holds {} values, expected {} x {}",
            want.len(),
            ids.len(),
            m.spec.vocab_size
        );
    }
    let mut cache = KvCache::new(&m.spec);
    let normed = m.forward(&ids, &mut cache, ForwardOptions::default(), None)?;
    let got = m.logits(&normed, ids.len())?;
    common::finish(&e, store)?;
    let a = ops::quality::compare(&got, &want, m.spec.vocab_size);
    if json {
        println!(
            "{}",
            serde_json::json!({"positions": a.positions, "top1": a.top1, "mean_kl": a.mean_kl, "max_kl": a.max_kl})
        );
    } else {
        println!(
            "{} positions: top-1 agreement {:.1}%, mean KL {:.3e} nats, max KL {:.3e}",
            a.positions,
            100.0 * a.top1,
            a.mean_kl,
            a.max_kl
        );
    }
    Ok(())
}

fn read_ids_file(p: &Path) -> Result<Vec<u32>> {
    let f = charm_shared::safetensors::SafetensorsFile::open(p)?;
    token_ids(&f, "ids").with_context(|| format!("reading {}", p.display()))
}

/// Integer tensor `name` of `f` as token ids (refusing negative or too large values).
fn token_ids(f: &charm_shared::safetensors::SafetensorsFile, name: &str) -> Result<Vec<u32>> {
    f.ints(name)
        .map_err(anyhow::Error::msg)?
        .into_iter()
        .map(|v| u32::try_from(v).with_context(|| format!("`{name}` holds {v}, not a token id")))
        .collect()
}

/// The flags of `charm evaluate`.
#[derive(Args, Debug)]
pub struct EvaluateArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(
        long,
        conflicts_with = "text_file",
        required_unless_present = "text_file"
    )]
    pub ids_file: Option<PathBuf>,
    #[arg(long)]
    pub text_file: Option<PathBuf>,
    /// Tokens predicted per window (each window is scored without cache from the previous).
    #[arg(long, default_value_t = 256)]
    pub window: usize,
    #[arg(long, default_value_t = 64)]
    pub max_windows: usize,
    #[arg(long, value_enum, default_value = "f32")]
    pub activations: Act,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// `charm evaluate`: perplexity, top-1 accuracy, MTP acceptance and routing skew over windows of
/// a token-id or text file.
pub fn evaluate(a: &EvaluateArgs) -> Result<()> {
    let (model, ids_file, text_file) = (&a.model, a.ids_file.as_deref(), a.text_file.as_deref());
    let (window, max_windows, json, store) = (a.window, a.max_windows, a.json, &a.store);
    let act: Activations = a.activations.into();
    if window < 2 {
        bail!("--window must be at least 2");
    }
    let ids = match (ids_file, text_file) {
        (Some(p), _) => read_ids_file(p)?,
        (None, Some(t)) => TextTokenizer::load(model)?.encode(
            &std::fs::read_to_string(t).with_context(|| format!("reading {}", t.display()))?,
        )?,
        _ => bail!("give --ids-file or --text-file"),
    };
    let engine = common::load(model, store, window + 1, act)?;
    let e = ops::evaluate::evaluate(&engine.model, &ids, window, max_windows)?;
    common::finish(&engine, store)?;
    if e.windows == 0 {
        bail!(
            "{} tokens do not fill one window of {}",
            ids.len(),
            window + 1
        );
    }
    let v = serde_json::json!({
        "tokens": e.tokens, "windows": e.windows, "perplexity": e.perplexity, "top1_accuracy": e.top1_accuracy,
        "mtp_accuracy": e.mtp_accuracy, "mtp_acceptance": e.mtp_acceptance,
        "top10pct_expert_share": e.top10pct_share, "routing_entropy": e.routing_entropy,
    });
    if json {
        println!("{v}");
    } else {
        println!("{}", serde_json::to_string_pretty(&v)?);
    }
    Ok(())
}
