//! A run's end (its model files, the final checkpoint, the sample) fits in
//! the memory its training steps held: the process's peak RSS after the run
//! is within 10% of its peak when the last step was done; and a stage's
//! state goes into its checkpoint without a second copy. Its own test
//! binary, one test: the peak RSS is the process's, and no other test may
//! share it.

#[path = "support/scratch.rs"]
mod scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::metrics::peak_rss_bytes;
use distgpt::model::gpt2::init_full;
use distgpt::model::{AdamWConfig, GptConfig};
use distgpt::parallel::{self, launch, ParallelConfig};
use distgpt::train::{train_lm, Duration, TrainConfig};

#[test]
fn the_end_of_a_run_fits_in_the_memory_of_its_steps() {
    let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    // parameters and moments of tens of MiB (the end copies them) beside
    // activations several times their size (the steps hold them), as in
    // most training: 6 layers 192 wide at 8 x 256 tokens
    let mut model = GptConfig::preset("tiny").unwrap();
    model.vocab_size = ds.tokenizer.vocab_size();
    (model.n_layer, model.n_embd, model.n_head, model.block_size) = (6, 192, 6, 256);
    let dir = scratch::scratch("end-of-run-memory");
    let cfg = TrainConfig {
        batch_size: 8,
        seq_len: 256,
        duration: Duration::Steps(2),
        sample_tokens: 20,
        out_dir: dir.clone(),
        peak_flops: Some(1e11),
        ..TrainConfig::default()
    };
    let s = train_lm(
        Cpu::new,
        model,
        &ds,
        &cfg,
        ParallelConfig::single(),
        2,
        std::time::Duration::from_secs(60),
    )
    .unwrap();
    let (Some(steps), Some(end)) = (s.peak_rss_at_last_step, peak_rss_bytes()) else {
        panic!("no /proc/self/status here: this test needs Linux");
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "peak RSS {:.1} MiB after the run, {:.1} MiB at the last step",
        mib(end),
        mib(steps)
    );
    assert!(
        end as f64 <= 1.10 * steps as f64,
        "peak RSS {:.1} MiB after the run, {:.1} MiB when its last step was done (model state {:.1} MiB)",
        mib(end),
        mib(steps),
        mib(s.memory.peak_bytes.params + s.memory.peak_bytes.grads + s.memory.peak_bytes.optimizer)
    );
    std::fs::remove_dir_all(&dir).unwrap();

    // The checkpoint's part of a stage's state: one copy of params and
    // both moments read from the buffers, moved (not copied again) into
    // what the checkpoint writes. Measured from a reset peak (Linux's
    // clear_refs 5) to the peak across `owned_state`.
    let big = GptConfig {
        n_layer: 4,
        n_head: 4,
        n_embd: 512,
        block_size: 16,
        vocab_size: 64,
        blocks: Vec::new(),
    };
    let init = init_full(&big, 1);
    let state_bytes = 3 * 4 * init.len() as u64;
    let grew = launch::run_local(1, 2, std::time::Duration::from_secs(60), |world| {
        let s = parallel::build(
            Cpu::new(),
            big.clone(),
            ParallelConfig::single(),
            world.as_ref(),
            AdamWConfig::default(),
            1,
            16,
        )?;
        let before = distgpt::metrics::rss_bytes().unwrap();
        std::fs::write("/proc/self/clear_refs", "5").expect("the peak RSS can be reset");
        let owned = s.owned_state()?;
        let peak = peak_rss_bytes().unwrap();
        assert_eq!(owned.params.len(), init.len());
        Ok(peak.saturating_sub(before))
    })
    .unwrap()[0];
    assert!(
        (grew as f64) < 1.5 * state_bytes as f64,
        "owned_state grew the process by {:.1} MiB for {:.1} MiB of state (a second copy?)",
        mib(grew),
        mib(state_bytes)
    );
}
