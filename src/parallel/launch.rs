//! Starting ranks: N threads of this process over `comm::local`, each with
//! its own share of the cores. A rank that errors or panics marks the world
//! failed, so the others stop with an error naming it.

use crate::comm::local;
use crate::comm::Comm;
use crate::error::{Error, Result};
use std::time::Duration;

/// The worker threads each of `n` thread ranks gets of `threads`.
pub fn rank_threads(threads: usize, n: usize) -> usize {
    (threads / n.max(1)).max(1)
}

/// Runs `f` on `n` thread ranks (threads / n worker threads each) and returns
/// their results in rank order, or the first failure.
pub fn run_local<R: Send>(
    n: usize,
    threads: usize,
    timeout: Duration,
    f: impl Fn(Box<dyn Comm>) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let (world, comms) = local::world(n, timeout);
    let per_rank = rank_threads(threads, n);
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (world, f) = (world.clone(), &f);
                s.spawn(move || {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(per_rank)
                        .build()
                        .map_err(|e| Error::Config(format!("rank {rank}: thread pool: {e}")))?;
                    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        pool.install(|| f(Box::new(comm.sharing_threads(per_rank * n))))
                    }));
                    let out = out.unwrap_or_else(|p| {
                        let why = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                        Err(Error::Comm(format!(
                            "rank {rank} panicked: {}",
                            why.unwrap_or_default()
                        )))
                    });
                    if let Err(e) = &out {
                        world.fail(rank, e.to_string());
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Comm("rank thread died".into())))
            })
            .collect()
    });
    // Report the rank that failed first rather than the peers that noticed it.
    let mut out = Vec::with_capacity(n);
    let mut first_err = None;
    for r in results {
        match r {
            Ok(v) => out.push(v),
            Err(e) => {
                let is_origin = !e.to_string().contains("aborted: rank");
                if first_err.is_none() || is_origin {
                    first_err = Some(e);
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}
