//! How a backend's work meets the host's threads: the threading policy
//! every backend answers with one value ([`Device::threads`]) instead of
//! four methods of its own. The CPU runs its operations on rayon's pool, so
//! rows may run in parts side by side (a batch's sequences in training, a
//! decoding step's rows) and a loop of small operations is best issued
//! from a worker; a GPU queues its kernels from one host thread, where
//! parts would only serialize.
//!
//! [`Device::threads`]: super::Device::threads

/// A backend's threading policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Threads {
    /// Operations run on rayon's current pool (the CPU).
    Pool,
    /// Operations are queued from the calling thread (a GPU).
    Queue,
}

/// The most matmul parameters a model may have for its decoding steps to
/// run as one part of the rows a thread ([`Threads::decode_parts`]): then
/// no operation is handed between threads, where a small model's hundreds
/// of operations a step each cost a hand-over (2-3 µs); a larger model's
/// matrices are read once a step for all rows instead of once a part. On
/// the 2-core machine this was measured on (32 MiB L3), batch 12, parts
/// against whole-batch operations: 0.8M parameters (the default model) fp32
/// 1.27x, int8 1.64x; 10.6M 1.11x, 2.03x; 37.7M 0.95x, 0.79x; GPT-2 124M
/// 0.95x, 0.83x.
const PARTS_MAX_PARAMS: usize = 16 << 20;

/// How many parameters a token of a batch's part may meet at most
/// ([`Threads::batch_parts`]): each part reads every weight again and
/// keeps its own copy of a unit's gradient, which pays while a part has
/// tokens enough to amortize them. Measured on 2 threads (Zen 5), parts
/// against both threads sharing every operation, tokens a part /
/// parameters a token: shakespeare-char 16 x 256 (2,048 / 11.9M) +3-6%, in
/// bf16 +4%; bert-minilm classify 32 x 128 (2,048 / 11.2M) +2%; GPT-2 124M
/// 16 x 128 (1,024 / 126M) -1.5%, 4 x 128 (256) -7%.
const PART_PARAMS_PER_TOKEN: f64 = 32_768.0;

/// The parts a rank on `threads` threads runs a batch of `rows`
/// sequences of `t` tokens in, for a model whose tokens each meet `params`
/// parameters: a part a thread, each with at least a token for every
/// `PART_PARAMS_PER_TOKEN` of them.
pub fn pool_batch_parts(threads: usize, rows: usize, t: usize, params: f64) -> usize {
    let most = (rows * t) as f64 * PART_PARAMS_PER_TOKEN / params.max(1.0);
    threads.min(rows).min(most as usize).max(1)
}

impl Threads {
    /// Runs `f`, a loop issuing many small operations (a decoding loop),
    /// where they are cheapest to issue: in a pool, on one of its workers,
    /// so each parallel operation starts on the calling worker instead of
    /// being handed across threads.
    pub fn in_pool<R: Send>(self, f: impl FnOnce() -> R + Send) -> R {
        match self {
            // a scope's body runs on a worker (this one, if it is one already)
            Threads::Pool => rayon::scope(|_| f()),
            Threads::Queue => f(),
        }
    }

    /// How many parts of consecutive rows a decoding step of `rows` rows
    /// runs as, each part through the whole model on its own
    /// ([`Threads::for_each_part`]), for a model of `matmul_params`
    /// parameters in its matmuls: a part a thread for a model up to
    /// `PARTS_MAX_PARAMS` in a pool, else one (every operation over all
    /// rows).
    pub fn decode_parts(self, rows: usize, matmul_params: usize) -> usize {
        match self == Threads::Pool && matmul_params <= PARTS_MAX_PARAMS {
            true => rayon::current_num_threads().min(rows),
            false => 1,
        }
    }

    /// How many parts of its sequences a training batch of `rows`
    /// sequences of `t` tokens runs as, each through every operation on its
    /// own, side by side ([`crate::model::parts::Parts`]), for a model
    /// whose tokens each meet `params` parameters (its training FLOPs a
    /// token over 6): [`pool_batch_parts`] on the pool's threads, else one.
    pub fn batch_parts(self, rows: usize, t: usize, params: f64) -> usize {
        match self {
            Threads::Pool => pool_batch_parts(rayon::current_num_threads(), rows, t, params),
            Threads::Queue => 1,
        }
    }

    /// `f` of every part, side by side in a pool, in turn on a queue.
    pub fn for_each_part<T: Send, R: Send>(
        self,
        parts: &mut [T],
        f: impl Fn(&mut T) -> R + Sync,
    ) -> Vec<R> {
        match self {
            Threads::Pool => {
                use rayon::prelude::*;
                parts.par_iter_mut().map(&f).collect()
            }
            Threads::Queue => parts.iter_mut().map(f).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_runs_everything_as_one_part_in_order() {
        let q = Threads::Queue;
        assert_eq!((q.decode_parts(8, 1000), q.batch_parts(8, 64, 1e3)), (1, 1));
        let mut order = vec![];
        let mut parts = [1, 2, 3];
        let seen = std::sync::Mutex::new(&mut order);
        let doubled = q.for_each_part(&mut parts, |p| {
            seen.lock().unwrap().push(*p);
            *p * 2
        });
        assert_eq!((doubled, order), (vec![2, 4, 6], vec![1, 2, 3]));
    }

    #[test]
    fn a_pool_splits_rows_a_part_a_thread_while_parts_pay() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        pool.install(|| {
            let p = Threads::Pool;
            assert_eq!(p.decode_parts(8, PARTS_MAX_PARAMS), 4);
            assert_eq!(p.decode_parts(2, 1000), 2);
            assert_eq!(p.decode_parts(8, PARTS_MAX_PARAMS + 1), 1);
            // 4 rows x 64 tokens x 32,768 / 2^22 = 2 parts of tokens enough
            assert_eq!(p.batch_parts(4, 64, (1 << 22) as f64), 2);
            assert_eq!(p.batch_parts(8, 1024, 1e3), 4);
            let mut parts = [1, 2, 3];
            assert_eq!(p.for_each_part(&mut parts, |x| *x + 1), vec![2, 3, 4]);
            assert!(p.in_pool(|| rayon::current_thread_index().is_some()));
        });
        assert!(Threads::Queue.in_pool(|| rayon::current_thread_index().is_none()));
    }
}
