//! Ranks as processes under Open MPI (`mpirun -np N distgpt ... --comm mpi`).
//!
//! MPI cannot time out a blocked collective itself, so a watchdog thread
//! watches each call: past the timeout it reports the stuck collective and
//! exits, which makes mpirun stop every rank. A rank whose training fails
//! calls MPI_Abort, and mpirun names it.

use super::{record, Comm, CommStats, Kind};
use crate::error::{Error, Result};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Watches the collective in flight, if any.
struct Watchdog {
    in_flight: Mutex<Option<(Instant, &'static str)>>,
    timeout: Duration,
    rank: usize,
}

impl Watchdog {
    fn start(rank: usize, timeout: Duration) -> Arc<Self> {
        let w = Arc::new(Watchdog {
            in_flight: Mutex::new(None),
            timeout,
            rank,
        });
        let watcher = w.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(100));
            let stuck = *watcher.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((since, what)) = stuck {
                if since.elapsed() > watcher.timeout {
                    crate::errln!(
                        "error: rank {}: {what} did not complete within {:.0} s: another rank is dead or stuck",
                        watcher.rank,
                        watcher.timeout.as_secs_f64()
                    );
                    std::process::exit(1);
                }
            }
        });
        w
    }

    fn guard<R>(&self, what: &'static str, f: impl FnOnce() -> R) -> R {
        *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), what));
        let out = f();
        *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()) = None;
        out
    }
}

pub struct MpiComm {
    comm: SimpleCommunicator,
    watchdog: Arc<Watchdog>,
    stats: Mutex<CommStats>,
    /// Kept alive while any communicator is: dropping it finalises MPI.
    _universe: Arc<Universe>,
}

// SAFETY: MPI is initialised with MPI_THREAD_FUNNELED and a rank calls its
// communicators from its main thread only (rayon workers never touch them).
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl MpiComm {
    /// Initialises MPI; this process's rank in MPI_COMM_WORLD.
    pub fn init(timeout: Duration) -> Result<Self> {
        let (universe, _) = mpi::initialize_with_threading(Threading::Funneled)
            .ok_or_else(|| Error::Comm("MPI is already initialised".into()))?;
        let comm = universe.world();
        let watchdog = Watchdog::start(comm.rank() as usize, timeout);
        Ok(MpiComm {
            comm,
            watchdog,
            stats: Mutex::default(),
            _universe: Arc::new(universe),
        })
    }

    /// Reports `why` and stops every rank of the job (MPI_Abort).
    pub fn abort(&self, why: &str) -> ! {
        crate::errln!("error: rank {}: {why}", self.rank());
        self.comm.abort(1)
    }

    fn timed<R>(
        &self,
        kind: Kind,
        what: &'static str,
        full_len: usize,
        f: impl FnOnce() -> R,
    ) -> R {
        let t0 = Instant::now();
        let out = self.watchdog.guard(what, f);
        record(&self.stats, kind, self.size(), full_len, t0);
        out
    }
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn size(&self) -> usize {
        self.comm.size() as usize
    }

    fn all_reduce(&self, buf: &mut [f32]) -> Result<()> {
        let send = buf.to_vec();
        self.timed(Kind::AllReduce, "all_reduce", buf.len(), || {
            self.comm
                .all_reduce_into(&send[..], buf, SystemOperation::sum())
        });
        Ok(())
    }

    fn reduce_scatter(&self, input: &[f32], out: &mut [f32]) -> Result<()> {
        assert_eq!(input.len(), out.len() * self.size(), "reduce_scatter sizes");
        self.timed(Kind::ReduceScatter, "reduce_scatter", input.len(), || {
            self.comm
                .reduce_scatter_block_into(input, out, SystemOperation::sum())
        });
        Ok(())
    }

    fn all_gather(&self, input: &[f32], out: &mut [f32]) -> Result<()> {
        assert_eq!(out.len(), input.len() * self.size(), "all_gather sizes");
        self.timed(Kind::AllGather, "all_gather", out.len(), || {
            self.comm.all_gather_into(input, out)
        });
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        let n = buf.len();
        self.timed(Kind::Broadcast, "broadcast", n, || {
            self.comm.process_at_rank(root as i32).broadcast_into(buf)
        });
        Ok(())
    }

    fn send(&self, buf: &[f32], to: usize) -> Result<()> {
        self.timed(Kind::P2p, "send", buf.len(), || {
            self.comm.process_at_rank(to as i32).send(buf)
        });
        Ok(())
    }

    fn recv(&self, buf: &mut [f32], from: usize) -> Result<()> {
        let n = buf.len();
        let status = self.timed(Kind::P2p, "recv", n, || {
            self.comm.process_at_rank(from as i32).receive_into(buf)
        });
        let got = status.count(f32::equivalent_datatype()) as usize;
        if got != n {
            return Err(Error::Comm(format!(
                "recv from rank {from}: got {got} floats, expected {n}"
            )));
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.watchdog.guard("barrier", || self.comm.barrier());
        Ok(())
    }

    fn barrier_after_io(&self) -> Result<()> {
        // Not watched: a rank that dies ends the job through mpirun instead.
        self.comm.barrier();
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Comm>> {
        let sub = self
            .watchdog
            .guard("split", || {
                self.comm
                    .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            })
            .ok_or_else(|| {
                Error::Comm(format!(
                    "rank {}: MPI returned no communicator for color {color}",
                    self.rank()
                ))
            })?;
        Ok(Box::new(MpiComm {
            comm: sub,
            watchdog: self.watchdog.clone(),
            stats: Mutex::default(),
            _universe: self._universe.clone(),
        }))
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}
