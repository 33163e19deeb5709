//! Process groups: the collectives every strategy is written against.
//!
//! `local` runs N ranks as threads of one process; `mpi` (feature `mpi`) runs
//! them as processes under `mpirun`. Every collective either completes or
//! returns an error within the group's timeout: a dead rank never hangs the rest.
//! Collectives are typed ([`CommElem`]): counts, flags and paths travel as
//! integers and bytes, not through f32.

pub mod device;
mod elem;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;

pub use elem::{Buf, BufMut, CommElem, DType};

use crate::backend::Backend;
use crate::error::{Error, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Bytes each rank sends per collective kind (ring-algorithm volumes:
/// all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the full
/// buffer), the calls made and the seconds spent inside collectives.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct CommStats {
    pub all_reduce_bytes: u64,
    pub reduce_scatter_bytes: u64,
    pub all_gather_bytes: u64,
    pub broadcast_bytes: u64,
    pub p2p_bytes: u64,
    pub calls: u64,
    pub seconds: f64,
}

impl CommStats {
    pub fn total_bytes(&self) -> u64 {
        self.all_reduce_bytes
            + self.reduce_scatter_bytes
            + self.all_gather_bytes
            + self.broadcast_bytes
            + self.p2p_bytes
    }

    /// What was sent since `before`, an earlier reading of the same counters.
    pub fn since(&self, before: &CommStats) -> CommStats {
        CommStats {
            all_reduce_bytes: self.all_reduce_bytes - before.all_reduce_bytes,
            reduce_scatter_bytes: self.reduce_scatter_bytes - before.reduce_scatter_bytes,
            all_gather_bytes: self.all_gather_bytes - before.all_gather_bytes,
            broadcast_bytes: self.broadcast_bytes - before.broadcast_bytes,
            p2p_bytes: self.p2p_bytes - before.p2p_bytes,
            calls: self.calls - before.calls,
            seconds: self.seconds - before.seconds,
        }
    }

    pub fn add(&mut self, o: &CommStats) {
        self.all_reduce_bytes += o.all_reduce_bytes;
        self.reduce_scatter_bytes += o.reduce_scatter_bytes;
        self.all_gather_bytes += o.all_gather_bytes;
        self.broadcast_bytes += o.broadcast_bytes;
        self.p2p_bytes += o.p2p_bytes;
        self.calls += o.calls;
        self.seconds += o.seconds;
    }
}

#[derive(Clone, Copy)]
pub enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    P2p,
}

/// The backend handle rank `world.rank()` trains with: on its own device
/// for thread ranks of a device-native group (NCCL, one GPU per rank), a
/// fresh handle on `backend`'s device otherwise.
pub fn backend_for<B: Backend>(backend: &B, world: &dyn Comm) -> Result<B> {
    let own = world.device_native().is_some() && world.shared_threads().is_some();
    backend.for_rank(own.then(|| world.rank()))
}

/// Counts a collective over `full_bytes` (the unsharded buffer) in `stats`.
pub fn record(stats: &Mutex<CommStats>, kind: Kind, n: usize, full_bytes: usize, started: Instant) {
    let bytes = full_bytes as u64;
    let ring = |num: u64| {
        if n > 1 {
            bytes * num * (n as u64 - 1) / n as u64
        } else {
            0
        }
    };
    let mut s = stats.lock().unwrap_or_else(|e| e.into_inner());
    match kind {
        Kind::AllReduce => s.all_reduce_bytes += ring(2),
        Kind::ReduceScatter => s.reduce_scatter_bytes += ring(1),
        Kind::AllGather => s.all_gather_bytes += ring(1),
        Kind::Broadcast => s.broadcast_bytes += if n > 1 { bytes } else { 0 },
        Kind::P2p => s.p2p_bytes += bytes,
    }
    s.calls += 1;
    // a group of one neither sends nor waits: its call's time is no
    // communication (a single rank's step spent none in collectives)
    if n > 1 {
        s.seconds += started.elapsed().as_secs_f64();
    }
}

/// One process group. Buffers arrive tagged with their element type
/// ([`Buf`], [`BufMut`]); callers use the typed methods on `dyn Comm`
/// (`all_reduce(&mut [T])`, ...). Float sums are taken in rank order, so
/// every rank gets bitwise the same result; integer sums are exact (wrapping).
pub trait Comm: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// buf = sum over ranks of buf.
    fn all_reduce_buf(&self, buf: BufMut<'_>) -> Result<()>;
    /// out (len n) = rank r's slice r of the sum of every rank's input (len n * size).
    fn reduce_scatter_buf(&self, input: Buf<'_>, out: BufMut<'_>) -> Result<()>;
    /// out (len n * size) = every rank's input (len n), in rank order.
    fn all_gather_buf(&self, input: Buf<'_>, out: BufMut<'_>) -> Result<()>;
    /// buf = root's buf.
    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    fn send_buf(&self, buf: Buf<'_>, to: usize) -> Result<()>;
    /// buf = the next message from `from`, which must have buf's type and length.
    fn recv_buf(&self, buf: BufMut<'_>, from: usize) -> Result<()>;
    /// Sends `send` to `to` and receives `recv` from `from` as one exchange
    /// (a pipeline stage trading with a neighbour, who may be sending to it
    /// at the same moment: neither waits on the other's unmatched send).
    /// Groups whose sends never wait for the receiver send, then receive.
    fn send_recv_buf(&self, send: Buf<'_>, to: usize, recv: BufMut<'_>, from: usize) -> Result<()> {
        self.send_buf(send, to)?;
        self.recv_buf(recv, from)
    }
    fn barrier(&self) -> Result<()>;
    /// A barrier that waits as long as the slowest rank's file writes take
    /// (a checkpoint of a large model): no timeout, but a rank that fails
    /// still stops the others.
    fn barrier_after_io(&self) -> Result<()>;
    /// Sub-groups: ranks with the same color form one, ordered by key.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Comm>>;
    /// What this rank has sent and waited so far, through this group.
    fn stats(&self) -> CommStats;
    /// For ranks that are threads of one process: the worker threads they
    /// share between them (so, the cores they run on). None for ranks with
    /// a process, and so cores, of their own.
    fn shared_threads(&self) -> Option<usize> {
        None
    }
    /// The group's collectives on device memory by address, where it has
    /// them (NCCL): `comm::device` hands them device views without staging.
    fn device_native(&self) -> Option<&dyn device::DeviceCollectives> {
        None
    }
    /// Why a rank of this launch failed, where the group can tell without
    /// waiting (thread ranks share a mark): a call that waits on another
    /// library (NCCL) asks it to stop rather than wait for a dead rank.
    fn failure(&self) -> Option<String> {
        None
    }
}

/// Waits until `done` says so, asking it over and over (a device's work,
/// without blocking on it): an error when `failure` names a failed rank or
/// `limit` passes first, for the caller to abort what it waits on.
pub fn wait_until(
    what: &str,
    limit: Duration,
    mut done: impl FnMut() -> Result<bool>,
    failure: impl Fn() -> Option<String>,
) -> Result<()> {
    let start = Instant::now();
    while !done()? {
        if let Some(why) = failure() {
            return Err(Error::Comm(format!("{what} aborted: {why}")));
        }
        if start.elapsed() > limit {
            return Err(Error::Comm(format!(
                "{what} timed out after {:.0} s (--comm-timeout) waiting for the other ranks",
                limit.as_secs_f64()
            )));
        }
        // spin as a stream's synchronise would for the first 50 ms (a
        // gradient bucket's all-reduce is a few: a sleep's wake-up would
        // add to each), then sleep: a wait that long is a slow rank
        match start.elapsed() < Duration::from_millis(50) {
            true => std::thread::yield_now(),
            false => std::thread::sleep(Duration::from_micros(200)),
        }
    }
    Ok(())
}

/// A value another rank sent as JSON.
fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes)
        .map_err(|e| Error::Comm(format!("another rank's value arrived garbled: {e}")))
}

/// The typed collectives every caller uses; each tags its slice and calls
/// the matching `*_buf` method.
impl dyn Comm + '_ {
    /// buf = sum over ranks of buf.
    pub fn all_reduce<T: CommElem>(&self, buf: &mut [T]) -> Result<()> {
        self.all_reduce_buf(T::buf_mut(buf))
    }

    /// out (len n) = rank r's slice r of the sum of every rank's input (len n * size).
    pub fn reduce_scatter<T: CommElem>(&self, input: &[T], out: &mut [T]) -> Result<()> {
        self.reduce_scatter_buf(T::buf(input), T::buf_mut(out))
    }

    /// out (len n * size) = every rank's input (len n), in rank order.
    pub fn all_gather<T: CommElem>(&self, input: &[T], out: &mut [T]) -> Result<()> {
        self.all_gather_buf(T::buf(input), T::buf_mut(out))
    }

    /// buf = root's buf.
    pub fn broadcast<T: CommElem>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_buf(T::buf_mut(buf), root)
    }

    pub fn send<T: CommElem>(&self, buf: &[T], to: usize) -> Result<()> {
        self.send_buf(T::buf(buf), to)
    }

    /// buf = the next message from `from`, which must have buf's type and length.
    pub fn recv<T: CommElem>(&self, buf: &mut [T], from: usize) -> Result<()> {
        self.recv_buf(T::buf_mut(buf), from)
    }

    /// Rank 0's `value` on every rank (rank 0 keeps its own; it crosses
    /// as JSON, which gives back every finite f64 it was given). Every
    /// rank's `value` is made, and only rank 0's used: one whose making
    /// has an effect belongs in an `Option`, `Some` on rank 0 alone.
    pub fn agree<T: Serialize + DeserializeOwned>(&self, value: T) -> Result<T> {
        if self.size() == 1 {
            return Ok(value);
        }
        let mut bytes = serde_json::to_vec(&value).map_err(|e| Error::Comm(e.to_string()))?;
        let mut len = [bytes.len() as u64];
        self.broadcast(&mut len, 0)?;
        bytes.resize(len[0] as usize, 0);
        self.broadcast(&mut bytes, 0)?;
        match self.rank() {
            0 => Ok(value),
            _ => decode(&bytes),
        }
    }

    /// Every rank's `value`, in rank order (each crosses as JSON, padded
    /// with spaces to the longest).
    pub fn gather<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        let mut bytes = serde_json::to_vec(value).map_err(|e| Error::Comm(e.to_string()))?;
        let mut lens = vec![0u64; self.size()];
        self.all_gather(&[bytes.len() as u64], &mut lens)?;
        let longest = lens.into_iter().max().unwrap_or(0) as usize;
        bytes.resize(longest, b' ');
        let mut all = vec![0u8; longest * self.size()];
        self.all_gather(&bytes, &mut all)?;
        all.chunks(longest.max(1)).map(decode).collect()
    }

    /// `send` to `to` and `recv` from `from`, as one exchange.
    pub fn send_recv<T: CommElem>(
        &self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<()> {
        self.send_recv_buf(T::buf(send), to, T::buf_mut(recv), from)
    }
}
