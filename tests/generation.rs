//! Generation with the KV cache under tensor parallelism follows the
//! single-rank model token for token (greedy).

use distgpt::backend::cpu::Cpu;
use distgpt::infer::generate::{decode, generate, SampleConfig};
use distgpt::infer::kv::{DecodeWeights, Decoder};
use distgpt::model::gpt2::shard_tp;
use distgpt::model::{Engine, Gpt2, GptConfig, TpPlace};
use distgpt::parallel::launch;
use std::time::Duration;

#[test]
fn tensor_parallel_greedy_generation_matches_one_rank() {
    let mut cfg = GptConfig::preset("tiny").unwrap();
    cfg.vocab_size = 60;
    let mut model = Gpt2::new(Cpu::new(), cfg.clone()).unwrap();
    model.init_weights(4);
    let prompts = vec![vec![3, 1, 4, 1, 5], vec![9, 2]];
    let sc = SampleConfig {
        max_new_tokens: 20,
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    let want = generate(&model, &prompts, &sc, None, |_, _| {}).unwrap();
    let got = launch::run_local(2, 2, Duration::from_secs(30), |comm| {
        let place = TpPlace {
            rank: comm.rank(),
            size: comm.size(),
        };
        let engine = Engine::new(Cpu::new(), cfg.clone(), place, false)?;
        let mut local = vec![0.0; engine.layout.total()];
        shard_tp(
            &model.params,
            &model.layout,
            &engine.layout,
            place,
            &mut local,
        );
        let weights = DecodeWeights::new(&Cpu::new(), &cfg, place, &local)?;
        let mut dec = Decoder::new(Cpu::new(), cfg.clone(), place, prompts.len(), 25)?;
        decode(
            &mut dec,
            &weights,
            &prompts,
            25,
            &sc,
            None,
            Some(comm.as_ref()),
            |_, _| {},
        )
    })
    .unwrap();
    assert_eq!(got[0], want);
    assert_eq!(got[1], want);
}
