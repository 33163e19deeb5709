//! Ranks as processes under Open MPI (`mpirun -np N distgpt ... --comm mpi`).
//!
//! MPI cannot time out a blocked collective itself, so a watchdog thread
//! watches each call: past the timeout it reports the stuck collective and
//! exits, which makes mpirun stop every rank. A rank whose training fails
//! calls MPI_Abort, and mpirun names it. Each element type travels as its
//! MPI datatype (MPI_FLOAT, MPI_DOUBLE, MPI_UINT32_T, ...).

use super::elem::typed;
use super::{record, Buf, BufMut, Comm, CommElem, CommStats, Kind};
use crate::error::{Error, Result};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

crate::named_enum! {
    /// The calls the watchdog watches; a health message carries `Call as u64 + 1`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Call {
        AllReduce = "all_reduce",
        ReduceScatter = "reduce_scatter",
        AllGather = "all_gather",
        Broadcast = "broadcast",
        Send = "send",
        Recv = "recv",
        SendRecv = "send_recv",
        Barrier = "barrier",
        Split = "split",
    }
    fn name
}

/// Health messages between watchdog threads: a question, and its answer.
const ASK: i32 = 1;
const ANSWER: i32 = 2;
/// How long a watchdog waits for the others' answers before naming the silent.
const GRACE: Duration = Duration::from_secs(3);

/// What a rank is doing: in which call, waiting on which world ranks, since when.
struct Doing {
    call: Option<(Call, Arc<[usize]>)>,
    since: Instant,
}

/// Watches the call in flight. Past the timeout it asks the ranks the call
/// waits on what they are doing, over a duplicate of MPI_COMM_WORLD that only
/// the watchdog threads use, and names those that do not answer (a stopped or
/// frozen process) or answer from outside any call (still computing).
struct Watchdog {
    doing: Mutex<Doing>,
    timeout: Duration,
    rank: usize,
    /// `None` where MPI gives no MPI_THREAD_MULTIPLE: nobody can be asked.
    health: Option<SimpleCommunicator>,
    /// Set before MPI is finalised: the thread must not call MPI after it.
    stopping: AtomicBool,
}

// SAFETY: `health` is used by the watchdog thread alone, and exists only
// under MPI_THREAD_MULTIPLE; the main thread touches `doing` only.
unsafe impl Send for Watchdog {}
unsafe impl Sync for Watchdog {}

impl Watchdog {
    fn start(
        rank: usize,
        timeout: Duration,
        health: Option<SimpleCommunicator>,
    ) -> (Arc<Self>, JoinHandle<()>) {
        let w = Arc::new(Watchdog {
            doing: Mutex::new(Doing {
                call: None,
                since: Instant::now(),
            }),
            timeout,
            rank,
            health,
            stopping: AtomicBool::new(false),
        });
        let watcher = w.clone();
        let thread = std::thread::spawn(move || {
            while !watcher.stopping.load(Ordering::Acquire) {
                watcher.watch();
            }
        });
        (w, thread)
    }

    /// One round: answer the questions waiting, and end the job if the call
    /// in flight is past the timeout.
    fn watch(&self) {
        std::thread::sleep(Duration::from_millis(50));
        self.answer();
        let stuck = {
            let d = self.doing();
            d.call.clone().filter(|_| d.since.elapsed() > self.timeout)
        };
        if let Some((call, on)) = stuck {
            let peers: Vec<usize> = on.iter().copied().filter(|&r| r != self.rank).collect();
            let why = self.diagnose();
            crate::errln!(
                "error: rank {}: {} with {} did not complete within {:.0} s: {why}",
                self.rank,
                call.name(),
                rank_list(&peers),
                self.timeout.as_secs_f64()
            );
            std::process::exit(1);
        }
    }

    fn doing(&self) -> std::sync::MutexGuard<'_, Doing> {
        self.doing.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn guard<R>(&self, call: Call, on: &Arc<[usize]>, f: impl FnOnce() -> R) -> R {
        *self.doing() = Doing {
            call: Some((call, on.clone())),
            since: Instant::now(),
        };
        let out = f();
        *self.doing() = Doing {
            call: None,
            since: Instant::now(),
        };
        out
    }

    /// Answers every question waiting: `[call + 1 or 0, milliseconds in it]`.
    fn answer(&self) {
        let Some(h) = &self.health else { return };
        while let Some((msg, status)) = h.any_process().immediate_matched_probe_with_tag(ASK) {
            let mut q = 0u8;
            msg.matched_receive_into(&mut q);
            let reply = {
                let d = self.doing();
                let call = d.call.as_ref().map_or(0, |(c, _)| *c as u64 + 1);
                [call, d.since.elapsed().as_millis() as u64]
            };
            h.process_at_rank(status.source_rank())
                .send_with_tag(&reply[..], ANSWER);
        }
    }

    /// Asks every other rank what it is doing; says who holds the job up.
    fn diagnose(&self) -> String {
        let Some(h) = &self.health else {
            return "another rank is dead or stuck (this MPI has no MPI_THREAD_MULTIPLE, \
                    so the ranks cannot be asked which)"
                .into();
        };
        let others: Vec<usize> = (0..h.size() as usize).filter(|&r| r != self.rank).collect();
        for &r in &others {
            h.process_at_rank(r as i32).send_with_tag(&1u8, ASK);
        }
        let mut answers = vec![None; others.len()];
        let asked = Instant::now();
        while answers.iter().any(Option::is_none) && asked.elapsed() < GRACE {
            self.answer();
            while let Some((msg, status)) = h.any_process().immediate_matched_probe_with_tag(ANSWER)
            {
                let mut a = [0u64; 2];
                msg.matched_receive_into(&mut a[..]);
                let from = status.source_rank() as usize;
                if let Some(i) = others.iter().position(|&r| r == from) {
                    answers[i] = Some(a);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        describe(&others, &answers)
    }
}

/// The watchdog's verdict from the answers of the `others` (`None`: no
/// answer): first the ranks that do not answer, then those outside any
/// collective (longest first); if every rank is inside one, where each waits.
fn describe(others: &[usize], answers: &[Option<[u64; 2]>]) -> String {
    let secs = |ms: u64| ms as f64 / 1e3;
    let mut silent = vec![];
    let mut busy = vec![];
    let mut waiting = vec![];
    for (&r, a) in others.iter().zip(answers) {
        match *a {
            None => silent.push(r),
            Some([0, ms]) => busy.push((ms, r)),
            Some([call, ms]) => waiting.push(format!(
                "rank {r} in {} ({:.0} s)",
                Call::ALL
                    .get(call as usize - 1)
                    .map_or("a call", |c| c.name()),
                secs(ms)
            )),
        }
    }
    busy.sort_by(|a, b| b.cmp(a));
    let mut why = vec![];
    if !silent.is_empty() {
        why.push(format!(
            "{} did not answer within {:.0} s: stopped (SIGSTOP, a debugger) or frozen",
            rank_list(&silent),
            GRACE.as_secs_f64()
        ));
    }
    why.extend(busy.iter().map(|&(ms, r)| {
        format!(
            "rank {r} is outside any collective for {:.0} s (computing, or hung)",
            secs(ms)
        )
    }));
    if why.is_empty() {
        if waiting.is_empty() {
            return "no other rank to wait on".into();
        }
        why.push(format!(
            "every rank is inside a collective, so they called different ones \
             (or the network is down): {}",
            waiting.join(", ")
        ));
    }
    why.join("; ")
}

/// "rank 3" or "ranks 1, 3".
fn rank_list(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match ranks {
        [_] => format!("rank {}", names[0]),
        _ => format!("ranks {}", names.join(", ")),
    }
}

/// MPI itself and the watchdog, kept alive while any communicator is.
struct Runtime {
    watchdog: Arc<Watchdog>,
    thread: Option<JoinHandle<()>>,
    /// Dropped last: finalises MPI.
    _universe: Universe,
}

impl Drop for Runtime {
    /// Stops the watchdog thread before its communicator is freed and MPI finalised.
    fn drop(&mut self) {
        self.watchdog.stopping.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub struct MpiComm {
    comm: SimpleCommunicator,
    /// The world rank of each rank of `comm`.
    members: Arc<[usize]>,
    stats: Mutex<CommStats>,
    runtime: Arc<Runtime>,
}

// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE where it offers it
// (else MPI_THREAD_FUNNELED); a rank calls its communicators from its main
// thread only (rayon workers never touch them), and the watchdog thread uses
// only its own duplicate of the world, and only under MPI_THREAD_MULTIPLE.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl MpiComm {
    /// Initialises MPI; this process's rank in MPI_COMM_WORLD.
    pub fn init(timeout: Duration) -> Result<Self> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| Error::Comm("MPI is already initialised".into()))?;
        let comm = universe.world();
        let health = (threading == Threading::Multiple).then(|| comm.duplicate());
        let (watchdog, thread) = Watchdog::start(comm.rank() as usize, timeout, health);
        Ok(MpiComm {
            members: (0..comm.size() as usize).collect(),
            comm,
            stats: Mutex::default(),
            runtime: Arc::new(Runtime {
                watchdog,
                thread: Some(thread),
                _universe: universe,
            }),
        })
    }

    /// Reports `why` and stops every rank of the job (MPI_Abort).
    pub fn abort(&self, why: &str) -> ! {
        crate::errln!("error: rank {}: {why}", self.rank());
        self.comm.abort(1)
    }

    /// Runs the call `what` over the whole communicator under the watchdog.
    fn timed<R>(&self, kind: Kind, call: Call, full_bytes: usize, f: impl FnOnce() -> R) -> R {
        self.timed_on(kind, call, &self.members, full_bytes, f)
    }

    /// Runs the call `what`, which waits on the world ranks `on`, under the watchdog.
    fn timed_on<R>(
        &self,
        kind: Kind,
        call: Call,
        on: &Arc<[usize]>,
        full_bytes: usize,
        f: impl FnOnce() -> R,
    ) -> R {
        let t0 = Instant::now();
        let out = self.runtime.watchdog.guard(call, on, f);
        record(&self.stats, kind, self.size(), full_bytes, t0);
        out
    }

    /// The world ranks of this communicator's `ranks`.
    fn world_ranks(&self, ranks: &[usize]) -> Arc<[usize]> {
        ranks.iter().map(|&r| self.members[r]).collect()
    }
}

/// The collectives over one element type; the `Comm` impl dispatches on the tag.
impl MpiComm {
    fn all_reduce_typed<T: CommElem + Equivalence>(&self, buf: &mut [T]) -> Result<()> {
        let send = buf.to_vec();
        self.timed(Kind::AllReduce, Call::AllReduce, size_of_val(buf), || {
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
        self.timed(Kind::ReduceScatter, Call::ReduceScatter, bytes, || {
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
        self.timed(Kind::AllGather, Call::AllGather, bytes, || {
            self.comm.all_gather_into(input, out)
        });
        Ok(())
    }

    fn broadcast_typed<T: CommElem + Equivalence>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let bytes = size_of_val(buf);
        self.timed(Kind::Broadcast, Call::Broadcast, bytes, || {
            self.comm.process_at_rank(root as i32).broadcast_into(buf)
        });
        Ok(())
    }

    fn send_typed<T: CommElem + Equivalence>(&self, buf: &[T], to: usize) -> Result<()> {
        let on = self.world_ranks(&[to]);
        self.timed_on(Kind::P2p, Call::Send, &on, size_of_val(buf), || {
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
        // the bytes a rank sends, as thread ranks and `plan` count them
        let bytes = size_of_val(send);
        let on = self.world_ranks(&[to, from]);
        let status = self.timed_on(Kind::P2p, Call::SendRecv, &on, bytes, || {
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
        let on = self.world_ranks(&[from]);
        // received bytes are the sender's: counted there
        let status = self.timed_on(Kind::P2p, Call::Recv, &on, 0, || {
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

    crate::comm::elem::typed!(comm_methods);

    fn send_recv_buf(&self, send: Buf<'_>, to: usize, recv: BufMut<'_>, from: usize) -> Result<()> {
        typed!(pair "send_recv", send, recv, s, r => self.send_recv_typed(s, to, r, from))
    }

    fn barrier(&self) -> Result<()> {
        self.runtime
            .watchdog
            .guard(Call::Barrier, &self.members, || self.comm.barrier());
        Ok(())
    }

    fn barrier_after_io(&self) -> Result<()> {
        // Not watched: a rank that dies ends the job through mpirun instead.
        self.comm.barrier();
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Comm>> {
        let sub = self
            .runtime
            .watchdog
            .guard(Call::Split, &self.members, || {
                self.comm
                    .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            })
            .ok_or_else(|| {
                Error::Comm(format!(
                    "rank {}: MPI returned no communicator for color {color}",
                    self.rank()
                ))
            })?;
        // A rank of `sub` is the same process as in `self`: its world rank
        // comes from translating between the two groups.
        let ranks: Vec<i32> = (0..sub.size()).collect();
        let mine = sub.group().translate_ranks(&ranks, &self.comm.group());
        let members = mine
            .iter()
            .map(|r| r.map(|r| self.members[r as usize]))
            .collect::<Option<Arc<[usize]>>>()
            .ok_or_else(|| {
                Error::Comm("a split communicator holds a rank its parent lacks".into())
            })?;
        Ok(Box::new(MpiComm {
            comm: sub,
            members,
            stats: Mutex::default(),
            runtime: self.runtime.clone(),
        }))
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::describe;

    #[test]
    fn the_verdict_names_the_silent_then_the_busy_then_where_the_rest_wait() {
        let v = describe(&[1, 2, 3], &[Some([1, 6000]), None, Some([0, 7000])]);
        assert_eq!(
            v,
            "rank 2 did not answer within 3 s: stopped (SIGSTOP, a debugger) or frozen; \
             rank 3 is outside any collective for 7 s (computing, or hung)"
        );
        let v = describe(&[0, 2], &[Some([0, 500]), Some([0, 9000])]);
        assert!(
            v.starts_with("rank 2 is outside any collective for 9 s"),
            "{v}"
        );
        let v = describe(&[1, 2], &[Some([4, 6000]), Some([1, 6000])]);
        assert_eq!(
            v,
            "every rank is inside a collective, so they called different ones \
             (or the network is down): rank 1 in broadcast (6 s), rank 2 in all_reduce (6 s)"
        );
        let v = describe(&[1, 2], &[None, None]);
        assert!(v.starts_with("ranks 1, 2 did not answer"), "{v}");
    }
}
