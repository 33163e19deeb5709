//! `distgpt generate`: sampling from a model with its KV cache, on one rank or tensor-parallel ranks.

use super::*;

#[derive(Args)]
pub(super) struct GenerateArgs {
    /// A run directory written by `distgpt train`, one of its checkpoint
    /// directories, or a Hugging Face GPT-2 folder.
    #[arg(value_name = "RUN", required_unless_present = "old_run")]
    run: Option<PathBuf>,
    /// `--run RUN`: RUN's spelling before it was positional.
    #[arg(long = "run", value_name = "RUN", hide = true, conflicts_with = "run")]
    old_run: Option<PathBuf>,
    /// Text to continue; repeat for a batch of prompts (default: <|endoftext|> for GPT-2 tokens, else a newline, or the first character where the model has none).
    #[arg(long)]
    prompt: Vec<String>,
    /// Tokens to generate.
    #[arg(long, value_parser = positive(), default_value_t = 500)]
    tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, value_parser = super::non_negative(), default_value_t = 40)]
    top_k: usize,
    /// Sample among the most likely tokens whose probabilities sum to p (1: all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampling.
    #[arg(long, value_parser = super::seed, allow_negative_numbers = true, default_value_t = 42)]
    seed: u64,
    /// Tensor-parallel ranks to split the model over (heads and MLP columns):
    /// threads here, or with --comm mpi every process mpirun starts.
    #[arg(long, value_parser = positive(), default_value_t = 1)]
    tp: usize,
    /// How the tp ranks run (as train's --comm).
    #[arg(long, value_enum, default_value = "local")]
    pub(super) comm: CommKind,
    /// Weight storage while decoding.
    #[arg(long, value_enum, default_value = "f32")]
    weights: WeightFormat,
    #[command(flatten)]
    device: DeviceArgs,
}

/// [`decode_on`]'s arguments, tokenizer, prompts, sampling and printer.
struct Decode<'a, S>(
    &'a GenerateArgs,
    &'a data::Tokenizer,
    &'a [Vec<u32>],
    &'a SampleConfig,
    &'a mut S,
);

impl<S: FnMut(usize, u32) + Send> OnBackend for Decode<'_, S> {
    type Out = Result<Option<(Vec<Vec<u32>>, usize)>>;
    fn run<B: Backend>(self, be: B) -> Self::Out {
        decode_on(be, self)
    }
}

/// Decodes on backend `be`: whole on this rank, or split over tp ranks
/// (threads or mpirun processes). None on mpi ranks other than 0.
fn decode_on<B: Backend, S: FnMut(usize, u32) + Send>(
    be: B,
    Decode(a, tk, prompts, cfg, show): Decode<'_, S>,
) -> Result<Option<(Vec<Vec<u32>>, usize)>> {
    let format = a.weights;
    // the whole model on the host; each rank takes its share
    let (meta, params) = checkpoint::read_model(a.run())?;
    let model = &meta.config;
    let generate = |be: B, tp: Option<&dyn Comm>, on_token: &mut (dyn FnMut(usize, u32) + Send)| {
        let run = Generation {
            params: &params,
            prompts,
            sample: cfg,
            stop: tk.eot(),
            format,
            tp,
            on_token,
        };
        model.decoder("generate")?.generate(be, run)
    };
    if a.tp <= 1 && a.comm == CommKind::Local {
        return Ok(Some((generate(be, None, &mut *show)?, 1)));
    }
    let show = std::sync::Mutex::new(show);
    let decode_rank = |comm: &dyn Comm| {
        if a.tp > 1 && a.tp != comm.size() {
            return Err(distgpt::error::Error::Input(format!(
                "--tp {} but mpirun started {} ranks: generate splits the model over all of them",
                a.tp,
                comm.size()
            )));
        }
        let lead = comm.rank() == 0;
        let mut on_token = |r, t| {
            if lead {
                (show.lock().expect("printer"))(r, t)
            }
        };
        let out = generate(
            distgpt::comm::backend_for(&be, comm)?,
            Some(comm),
            &mut on_token,
        )?;
        Ok((out, comm.size()))
    };
    let how = Launch {
        comm: a.comm,
        world_size: a.tp,
        timeout: std::time::Duration::from_secs(120),
        cuda_device: a.device.cuda(),
    };
    // Only rank 0 reports.
    Ok(how.run(decode_rank)?)
}

impl GenerateArgs {
    /// RUN, from either spelling (`run_generate` settles it first).
    fn run(&self) -> &Path {
        self.run.as_deref().expect("run_generate settles RUN first")
    }
}

/// Notes each prompt that stopped at the model's block short of its
/// `tokens` (one prompt without `--tp` slides its window: short, it met the
/// end of text).
fn note_block_stops(
    prompts: &[Vec<u32>],
    out: &[Vec<u32>],
    block: usize,
    tokens: usize,
    tp: usize,
) {
    let slides = prompts.len() == 1 && tp == 1;
    for (r, (p, o)) in prompts.iter().zip(out).enumerate() {
        if !slides && o.len() < tokens && p.len() + o.len() > block {
            distgpt::errln!(
                "note: prompt {r} stopped at the model's block of {block} positions ({} prompt + {} new tokens), short of --tokens {tokens}: only one prompt at a time, without --tp, slides its window on",
                p.len(),
                o.len(),
            );
        }
    }
}

pub(super) fn run_generate(mut a: GenerateArgs) -> Result<()> {
    a.run = Some(run_or_old_flag("generate", a.run.take(), a.old_run.take()));
    let meta = checkpoint::read_any_meta(a.run())?;
    if !meta.config.decodes() {
        bail!(
            "{} holds a {} model ({}), which does not generate text: generate reads causal language models (GPT-2)",
            a.run().display(),
            meta.config.family(),
            meta.config
        );
    }
    let tk = data::Tokenizer::from_spec(&meta.tokenizer)?;
    let prompts: Vec<Vec<u32>> = if a.prompt.is_empty() {
        vec![tk.no_prompt()]
    } else {
        a.prompt
            .iter()
            .map(|p| tk.encode(p))
            .collect::<distgpt::error::Result<_>>()?
    };
    let cfg = SampleConfig {
        max_new_tokens: a.tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    // One prompt streams: the prompt, then each token as it comes (printed by
    // the rank that samples, so once under mpirun too).
    let stream = prompts.len() == 1;
    let mut stdout = std::io::stdout();
    let mut shown_prompt = false;
    // when the first token came: after loading, packing and the prompts;
    // and the rows of the first step, which made one token each before any
    // row made its second
    let (mut first_at, mut first_rows, mut second) = (None, Vec::new(), false);
    let mut text = tk.stream();
    let mut show = |r: usize, tok: u32| {
        first_at.get_or_insert_with(std::time::Instant::now);
        second |= first_rows.contains(&r);
        if !second {
            first_rows.push(r);
        }
        if stream {
            if !shown_prompt {
                let _ = write!(stdout, "{}", a.prompt.first().map_or("", String::as_str));
                shown_prompt = true;
            }
            let _ = write!(stdout, "{}", text.push(tok));
            let _ = stdout.flush();
        }
    };
    let started = std::time::Instant::now();
    let Some((out, tp)) = a.device.run(Decode(&a, &tk, &prompts, &cfg, &mut show))? else {
        return Ok(()); // an mpi rank other than 0
    };
    let secs = started.elapsed().as_secs_f64();
    let after = first_at.map(|t| t.elapsed().as_secs_f64());
    if stream {
        // The streamed text ends with a newline, like any command's output;
        // with nothing generated, the prompt is all there was to stream.
        let prompt = a.prompt.first().map_or("", String::as_str);
        let rest = text.finish();
        distgpt::outln!("{}", if out[0].is_empty() { prompt } else { &rest });
    }
    if !stream {
        for (p, o) in a.prompt.iter().zip(&out) {
            distgpt::outln!("--- {p:?} ---\n{p}{}", tk.decode(o));
        }
    }
    note_block_stops(&prompts, &out, meta.config.block_size(), a.tokens, tp);
    let n: usize = out.iter().map(Vec::len).sum();
    // the rate after the first step's tokens: decoding alone, without the
    // load and the prompts
    let later = n - first_rows.len();
    let rate = match after {
        Some(after) if later > 0 && after > 0.0 => format!(
            ", the first after {:.2} s, then {:.1} tokens/s",
            secs - after,
            later as f64 / after
        ),
        _ => String::new(),
    };
    distgpt::errln!(
        "[{n} tokens in {secs:.2} s{rate}; {} prompt(s), tp {}, {} weights]",
        prompts.len(),
        tp,
        a.weights.name()
    );
    Ok(())
}
