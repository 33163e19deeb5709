//! Ranks as processes under Open MPI (`mpirun -np N distgpt ... --comm mpi`).
//!
//! MPI cannot time out a blocked collective itself, so a watchdog thread
//! watches each call: past the timeout it reports the stuck collective and
//! exits, which makes mpirun stop every rank. A rank whose training fails
//! calls MPI_Abort, and mpirun names it. Each element type travels as its
//! MPI datatype (MPI_FLOAT, MPI_DOUBLE, MPI_UINT32_T, ...).

use super::elem::{typed, typed_pair};
use super::{record, Buf, BufMut, Comm, CommElem, CommStats, Kind};
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
        full_bytes: usize,
        f: impl FnOnce() -> R,
    ) -> R {
        let t0 = Instant::now();
        let out = self.watchdog.guard(what, f);
        record(&self.stats, kind, self.size(), full_bytes, t0);
        out
    }
}

/// The collectives over one element type; the `Comm` impl dispatches on the tag.
impl MpiComm {
    fn all_reduce_typed<T: CommElem + Equivalence>(&self, buf: &mut [T]) -> Result<()> {
        let send = buf.to_vec();
        self.timed(Kind::AllReduce, "all_reduce", size_of_val(buf), || {
            self.comm
                .all_reduce_into(&send[..], buf, SystemOperation::sum())
        });
        Ok(())
    }

    fn reduce_scatter_typed<T: CommElem + Equivalence>(
        &self,
        input: &[T],
        out: &mut [T],
    ) -> Result<()> {
        assert_eq!(input.len(), out.len() * self.size(), "reduce_scatter sizes");
        let bytes = size_of_val(input);
        self.timed(Kind::ReduceScatter, "reduce_scatter", bytes, || {
            self.comm
                .reduce_scatter_block_into(input, out, SystemOperation::sum())
        });
        Ok(())
    }

    fn all_gather_typed<T: CommElem + Equivalence>(
        &self,
        input: &[T],
        out: &mut [T],
    ) -> Result<()> {
        assert_eq!(out.len(), input.len() * self.size(), "all_gather sizes");
        let bytes = size_of_val(out);
        self.timed(Kind::AllGather, "all_gather", bytes, || {
            self.comm.all_gather_into(input, out)
        });
        Ok(())
    }

    fn broadcast_typed<T: CommElem + Equivalence>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let bytes = size_of_val(buf);
        self.timed(Kind::Broadcast, "broadcast", bytes, || {
            self.comm.process_at_rank(root as i32).broadcast_into(buf)
        });
        Ok(())
    }

    fn send_typed<T: CommElem + Equivalence>(&self, buf: &[T], to: usize) -> Result<()> {
        self.timed(Kind::P2p, "send", size_of_val(buf), || {
            self.comm.process_at_rank(to as i32).send(buf)
        });
        Ok(())
    }

    /// MPI_Sendrecv: the send and the receive progress together.
    fn send_recv_typed<T: CommElem + Equivalence>(
        &self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<()> {
        let n = recv.len();
        let bytes = size_of_val(send) + size_of_val(recv);
        let status = self.timed(Kind::P2p, "send_recv", bytes, || {
            mpi::point_to_point::send_receive_into(
                send,
                &self.comm.process_at_rank(to as i32),
                recv,
                &self.comm.process_at_rank(from as i32),
            )
        });
        arrived::<T>(&status, n, "send_recv", from)
    }

    fn recv_typed<T: CommElem + Equivalence>(&self, buf: &mut [T], from: usize) -> Result<()> {
        let n = buf.len();
        let status = self.timed(Kind::P2p, "recv", size_of_val(buf), || {
            self.comm.process_at_rank(from as i32).receive_into(buf)
        });
        arrived::<T>(&status, n, "recv", from)
    }
}

/// Refuses a message from `from` that did not fill the `n` elements expected.
fn arrived<T: CommElem + Equivalence>(
    status: &mpi::point_to_point::Status,
    n: usize,
    what: &str,
    from: usize,
) -> Result<()> {
    let got = status.count(T::equivalent_datatype()) as usize;
    if got != n {
        return Err(Error::Comm(format!(
            "{what} from rank {from}: got {got} {} elements, expected {n}",
            T::DTYPE
        )));
    }
    Ok(())
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn size(&self) -> usize {
        self.comm.size() as usize
    }

    fn all_reduce_buf(&self, buf: BufMut<'_>) -> Result<()> {
        typed!(BufMut, buf, b => self.all_reduce_typed(b))
    }

    fn reduce_scatter_buf(&self, input: Buf<'_>, out: BufMut<'_>) -> Result<()> {
        typed_pair!("reduce_scatter", input, out, i, o => self.reduce_scatter_typed(i, o))
    }

    fn all_gather_buf(&self, input: Buf<'_>, out: BufMut<'_>) -> Result<()> {
        typed_pair!("all_gather", input, out, i, o => self.all_gather_typed(i, o))
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        typed!(BufMut, buf, b => self.broadcast_typed(b, root))
    }

    fn send_buf(&self, buf: Buf<'_>, to: usize) -> Result<()> {
        typed!(Buf, buf, b => self.send_typed(b, to))
    }

    fn recv_buf(&self, buf: BufMut<'_>, from: usize) -> Result<()> {
        typed!(BufMut, buf, b => self.recv_typed(b, from))
    }

    fn send_recv_buf(&self, send: Buf<'_>, to: usize, recv: BufMut<'_>, from: usize) -> Result<()> {
        typed_pair!("send_recv", send, recv, s, r => self.send_recv_typed(s, to, r, from))
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
