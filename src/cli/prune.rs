//! `prune`: a model pruned level by level, with its report.

use super::*;

#[derive(Args)]
pub(super) struct PruneArgs {
    /// A run directory, one of its checkpoint directories, or a model folder.
    #[arg(value_name = "RUN")]
    run: PathBuf,
    /// Output folder: the last level's model (model.safetensors, model.json;
    /// with --sweep one folder per method), prune.csv, prune.json and the figures.
    #[arg(long)]
    out: PathBuf,
    /// Write into --out even when it is the input or already holds files.
    #[arg(long)]
    overwrite: bool,
    /// magnitude: single weights, the matrices keep their shapes; rows:
    /// whole attention heads and MLP units by L2 norm, the matrices shrink.
    #[arg(
        long,
        value_enum,
        default_value = "magnitude",
        conflicts_with = "sweep"
    )]
    method: distgpt::prune::Method,
    /// Run both methods from the same model, timing every level: the
    /// report compares loss, time per training step and time per token.
    #[arg(long)]
    sweep: bool,
    /// Time each level (training steps and generated tokens); on with --sweep.
    #[arg(long)]
    measure: bool,
    /// Training steps timed one by one per level (after one untimed); the
    /// median counts.
    #[arg(long, value_parser = non_negative(), default_value_t = 10)]
    time_steps: usize,
    /// Tokens generated at batch 1 in each of three timed runs per level
    /// (at most the block size less one); the median run counts.
    #[arg(long, value_parser = non_negative(), default_value_t = 128)]
    time_tokens: usize,
    /// Sparsity levels, increasing, each a fraction of the weights pruned
    /// (one level, or a schedule such as 0.1,0.3,0.5,0.7,0.9).
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.3,0.5,0.7,0.9")]
    sparsity: Vec<f64>,
    /// matrix: each weight matrix (rows: each block) loses the same
    /// fraction; global: one threshold over all of them.
    #[arg(long, value_enum, default_value = "matrix")]
    scope: distgpt::prune::Scope,
    /// Fine-tuning steps after each pruning (AdamW, gradients clipped at 1).
    #[arg(long, value_parser = non_negative(), default_value_t = 0)]
    finetune_steps: usize,
    /// Fine-tuning learning rate (constant).
    #[arg(long, default_value_t = 1e-4, allow_negative_numbers = true)]
    lr: f32,
    /// Data: a text file or a shard directory (default: the embedded
    /// corpus): fine-tuning on its training split, evaluation on its validation split.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Sequences per batch (fine-tuning and evaluation).
    #[arg(long, value_parser = positive(), default_value_t = 8)]
    batch_size: usize,
    /// Tokens per sequence (default: the model's block size).
    #[arg(long, value_parser = positive())]
    seq_len: Option<usize>,
    /// Validation batches per evaluation.
    #[arg(long, value_parser = non_negative(), default_value_t = 20)]
    eval_batches: usize,
    /// Seed of the fine-tuning data order.
    #[arg(long, value_parser = super::seed, allow_negative_numbers = true, default_value_t = 1337)]
    seed: u64,
    /// Also evaluate the dense model and every level with int8 weights
    /// (CPU), reported beside their fp32 losses.
    #[arg(long)]
    int8: bool,
    #[command(flatten)]
    device: DeviceArgs,
}

/// `prune` on a backend.
struct Prune<'a>(&'a PruneArgs);

impl OnBackend for Prune<'_> {
    type Out = Result<()>;
    fn run<B: Backend>(self, be: B) -> Result<()> {
        let a = self.0;
        use distgpt::prune::{self, Level, Method, MethodRun, Timing};
        let (meta, params) = checkpoint::read_model(&a.run)?;
        // before its data, which an encoder's tokenizer would misname
        prune::check_family(&meta.config)?;
        let ds = Dataset::load_for_model(a.data.as_deref(), &meta.tokenizer)?;
        let model = prune::Model {
            backend: be,
            config: meta.config.clone(),
            params,
        };
        let mut cfg = prune::SweepConfig {
            levels: a.sparsity.clone(),
            method: a.method,
            scope: a.scope,
            finetune_steps: a.finetune_steps,
            lr: a.lr,
            batch_size: a.batch_size,
            seq_len: a.seq_len.unwrap_or(model.config.block_size()),
            eval_batches: a.eval_batches,
            seed: a.seed,
            int8: a.int8,
            timing: (a.sweep || a.measure).then_some(Timing {
                steps: a.time_steps,
                tokens: a.time_tokens,
            }),
        };
        cfg.validate()?;
        let say = |method: &str, l: &Level| {
            let int8 = |x: Option<f64>| x.map_or(String::new(), |v| format!(", {v:.4} in int8"));
            let speed = l.speed.map_or(String::new(), |s| {
                let int8 = s
                    .token_ms_int8
                    .map_or(String::new(), |v| format!(", {v:.2} in int8"));
                format!(
                    "; {:.1} ms/step, {:.2} ms/token{int8}",
                    s.step_ms, s.token_ms
                )
            });
            let loss = match l.target {
                0.0 => format!("val loss {:.4}", l.val_loss),
                _ => format!(
                    "val loss {:.4} right after pruning, {:.4} after {} fine-tuning steps",
                    l.val_loss_pruned, l.val_loss, cfg.finetune_steps
                ),
            };
            distgpt::outln!(
                "{method} {} ({:.2}% gone, {} parameters): {loss}{}{speed}",
                level_name(l.target),
                100.0 * l.sparsity,
                l.params,
                int8(l.val_loss_int8)
            )
        };
        let dense = prune::dense_level(&model, &ds, &cfg)?;
        say("dense", &dense);
        let methods = match a.sweep {
            true => vec![Method::Magnitude, Method::Rows],
            false => vec![a.method],
        };
        let mut runs = Vec::new();
        for method in methods {
            cfg.method = method;
            let mut m = prune::Model {
                backend: model.backend.clone_fresh(),
                config: model.config.clone(),
                params: model.params.clone(),
            };
            let pb = metrics::progress_bar(cfg.levels.len() as u64, &format!("prune ({method})"));
            let levels = prune::sweep(&mut m, &ds, &cfg, |l| {
                pb.suspend(|| say(&method.to_string(), l));
                pb.inc(1);
            })?;
            pb.finish_and_clear();
            let dir = match a.sweep {
                true => a.out.join(method.to_string()),
                false => a.out.clone(),
            };
            files::write_model(&m.config, &m.params, meta.tokenizer.clone(), &dir, false)?;
            distgpt::outln!(
                "wrote {} (the {} model: {})",
                dir.display(),
                level_name(cfg.levels.last().copied().unwrap_or(0.0)),
                m.config
            );
            runs.push(MethodRun {
                method,
                levels: std::iter::once(dense.clone()).chain(levels).collect(),
            });
        }
        let written = prune::write_report(&a.out, &cfg, &runs)?;
        distgpt::outln!(
            "wrote {} report files into {}",
            written.len(),
            a.out.display()
        );
        Ok(())
    }
}

/// `prune`: the model pruned level by level (weights or whole heads and MLP
/// units), on any device, with its report.
pub(super) fn run_prune(a: PruneArgs) -> Result<()> {
    distgpt::prune::check_levels(&a.sparsity)?;
    refuse_output_over_input(&a.run, &a.out, a.overwrite)?;
    a.device.run(Prune(&a))
}

/// A sparsity level as a percentage, with the decimals it needs (0.5:
/// "50%", 0.999: "99.9%"), so no level below 1 reads as 100%.
fn level_name(level: f64) -> String {
    let pct = format!("{:.6}", 100.0 * level);
    format!("{}%", pct.trim_end_matches('0').trim_end_matches('.'))
}

#[cfg(test)]
mod tests {
    use super::level_name;

    #[test]
    fn a_level_is_named_with_the_decimals_it_needs() {
        assert_eq!(level_name(0.5), "50%");
        assert_eq!(level_name(0.999), "99.9%");
        assert_eq!(level_name(0.12345), "12.345%");
        assert_eq!(level_name(0.9999999), "99.99999%");
    }
}
