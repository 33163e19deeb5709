//! N ranks as threads of one process, exchanging through shared memory.
//!
//! A collective is two rendezvous: every rank deposits its input, all read
//! what they need, and the second rendezvous keeps the slots alive until
//! everyone has read. A rank that fails marks the world; every waiting rank
//! sees the mark (or its timeout) and returns an error naming the rank.
//! Slots and messages hold a `Vec<T>` of the collective's element type.

use super::{record, Comm, CommElem, CommStats, DType, Kind};
use crate::error::{Error, Result};
use std::any::{Any, TypeId};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// State shared by every group of one launch.
pub struct World {
    failed: Mutex<Option<(usize, String)>>,
    timeout: Duration,
}

impl World {
    pub fn new(timeout: Duration) -> Arc<Self> {
        Arc::new(World {
            failed: Mutex::new(None),
            timeout,
        })
    }

    /// Marks world rank `rank` as failed; the first failure is kept.
    pub fn fail(&self, rank: usize, why: String) {
        let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some((rank, why));
        }
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// A point-to-point message: a `Vec<T>` of the element type it names.
type Message = (DType, Box<dyn Any + Send>);

struct State {
    generation: u64,
    arrived: Vec<bool>,
    /// Each rank's deposit: a `Vec<T>` of the collective's element type.
    slots: Vec<Box<dyn Any + Send>>,
    /// The length of the buffer each rank's deposit is (a part of).
    totals: Vec<usize>,
    /// Each rank's buffers of the other element types it deposited before,
    /// kept for their next deposit: a step's small f64 all-reduce between
    /// two large f32 collectives must not free and refault the large one.
    kept: Vec<HashMap<TypeId, Box<dyn Any + Send>>>,
    /// Messages from rank to rank.
    mail: HashMap<(usize, usize), VecDeque<Message>>,
    subgroups: HashMap<(u64, usize), Arc<Group>>,
    splits: u64,
}

struct Group {
    /// World rank of each member.
    members: Vec<usize>,
    state: Mutex<State>,
    cv: Condvar,
    world: Arc<World>,
}

impl Group {
    fn new(members: Vec<usize>, world: Arc<World>) -> Arc<Self> {
        let n = members.len();
        Arc::new(Group {
            members,
            state: Mutex::new(State {
                generation: 0,
                arrived: vec![false; n],
                slots: (0..n)
                    .map(|_| Box::new(()) as Box<dyn Any + Send>)
                    .collect(),
                totals: vec![0; n],
                kept: (0..n).map(|_| HashMap::new()).collect(),
                mail: HashMap::new(),
                subgroups: HashMap::new(),
                splits: 0,
            }),
            cv: Condvar::new(),
            world,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_failed(&self, what: &str) -> Result<()> {
        match self.world.failure() {
            Some((r, why)) => Err(Error::Comm(format!(
                "{what} aborted: rank {r} failed: {why}"
            ))),
            None => Ok(()),
        }
    }

    /// Waits on the condition variable until member `peer`'s message is
    /// `done`, the world fails, or the timeout passes.
    fn wait_for<'a>(
        &self,
        st: MutexGuard<'a, State>,
        what: &str,
        peer: usize,
        done: impl Fn(&State) -> bool,
    ) -> Result<MutexGuard<'a, State>> {
        self.wait_within(st, what, Some(self.world.timeout), Some(peer), done)
    }

    /// Waits until `done` or a failure, or `limit` passes (`None`: no
    /// limit); a timeout names `peer`, or else the members that have not
    /// arrived at the rendezvous.
    fn wait_within<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        what: &str,
        limit: Option<Duration>,
        peer: Option<usize>,
        done: impl Fn(&State) -> bool,
    ) -> Result<MutexGuard<'a, State>> {
        let start = Instant::now();
        while !done(&st) {
            self.check_failed(what)?;
            if limit.is_some_and(|l| start.elapsed() > l) {
                let missing: Vec<String> = st
                    .arrived
                    .iter()
                    .enumerate()
                    .filter(|&(i, &a)| peer.map_or(!a, |p| p == i))
                    .map(|(i, _)| self.members[i].to_string())
                    .collect();
                return Err(Error::Comm(format!(
                    "{what} timed out after {:.0} s waiting for rank(s) {}",
                    self.world.timeout.as_secs_f64(),
                    missing.join(", ")
                )));
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(20))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(st)
    }

    /// Rendezvous of every member.
    fn sync(&self, me: usize, what: &str) -> Result<()> {
        self.sync_within(me, what, Some(self.world.timeout))
    }

    /// Rendezvous of every member, waiting at most `limit` (`None`: until a failure).
    fn sync_within(&self, me: usize, what: &str, limit: Option<Duration>) -> Result<()> {
        let mut st = self.lock();
        self.check_failed(what)?;
        let generation = st.generation;
        st.arrived[me] = true;
        if st.arrived.iter().all(|&a| a) {
            st.arrived.fill(false);
            st.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        self.wait_within(st, what, limit, None, |s| s.generation != generation)
            .map(|_| ())
    }

    /// Copies `input`, a part of a buffer of `total` elements, into this
    /// rank's slot, reusing the allocation of its last deposit of this
    /// element type.
    fn deposit<T: CommElem>(&self, me: usize, input: &[T], total: usize) {
        let mut st = self.lock();
        let st = &mut *st;
        st.totals[me] = total;
        if !st.slots[me].is::<Vec<T>>() {
            let mine = st.kept[me]
                .remove(&TypeId::of::<Vec<T>>())
                .unwrap_or_else(|| Box::new(Vec::<T>::new()));
            let other = std::mem::replace(&mut st.slots[me], mine);
            st.kept[me].insert((*other).type_id(), other);
        }
        let v = st.slots[me]
            .downcast_mut::<Vec<T>>()
            .expect("the slot holds this type now");
        v.clear();
        v.extend_from_slice(input);
    }

    /// Once every rank has deposited, runs `read` over all slots (without
    /// the lock, so ranks read in parallel), then waits until all have read.
    /// Every rank sees the same slots, so a rank that deposited another
    /// element type makes all of them fail alike.
    fn read_all<T: CommElem, R>(
        &self,
        me: usize,
        what: &str,
        read: impl FnOnce(&[&[T]]) -> R,
    ) -> Result<R> {
        self.sync(me, what)?;
        // every rank sees the same totals: on other lengths all refuse alike
        // (a part of one rank's buffer would pair with another's next call)
        let (views, other_lengths): (Option<Vec<&[T]>>, Option<Vec<usize>>) = {
            let st = self.lock();
            // SAFETY: the slots belong to the group, which outlives this call,
            // and nobody writes a slot between the two rendezvous: deposits
            // happen only before a collective's first one, and no rank can
            // start the next collective before every rank has passed the second.
            let views = st
                .slots
                .iter()
                .map(|slot| {
                    let v = slot.downcast_ref::<Vec<T>>()?;
                    Some(unsafe { std::slice::from_raw_parts(v.as_ptr(), v.len()) })
                })
                .collect();
            let alike = st.totals.iter().all(|&t| t == st.totals[0]);
            (views, (!alike).then(|| st.totals.clone()))
        };
        let out = views.filter(|_| other_lengths.is_none()).map(|v| read(&v));
        self.sync(me, what)?;
        if let Some(totals) = other_lengths {
            return Err(Error::Comm(format!(
                "{what}: the ranks passed buffers of other lengths ({totals:?})"
            )));
        }
        out.ok_or_else(|| {
            Error::Comm(format!(
                "{what}: ranks passed different element types (rank {} passed {})",
                self.members[me],
                T::DTYPE
            ))
        })
    }

    /// Deposits `input`, and once everyone has, runs `read` over all slots.
    fn exchange<T: CommElem, R>(
        &self,
        me: usize,
        what: &str,
        input: &[T],
        read: impl FnOnce(&[&[T]]) -> R,
    ) -> Result<R> {
        self.deposit(me, input, input.len());
        self.read_all(me, what, read)
    }
}

pub struct LocalComm {
    rank: usize,
    group: Arc<Group>,
    stats: Mutex<CommStats>,
    /// The worker threads the world's ranks share (set by the launcher).
    shared_threads: Option<usize>,
}

impl LocalComm {
    /// This world rank, its ranks sharing `threads` worker threads.
    pub fn sharing_threads(self, threads: usize) -> Self {
        LocalComm {
            shared_threads: Some(threads),
            ..self
        }
    }
}

/// One communicator per rank of a new world of `n` threads.
pub fn world(n: usize, timeout: Duration) -> (Arc<World>, Vec<LocalComm>) {
    let w = World::new(timeout);
    let g = Group::new((0..n).collect(), w.clone());
    let comms = (0..n)
        .map(|rank| LocalComm {
            rank,
            group: g.clone(),
            stats: Mutex::default(),
            shared_threads: None,
        })
        .collect();
    (w, comms)
}

/// The elements an all-reduce passes through a rank's slot at a time (4
/// MiB of f32).
const ALL_REDUCE_PART: usize = 1 << 20;

/// out = the sum of `range` of every slot, added in rank order.
fn sum_slots<T: CommElem>(slots: &[&[T]], range: std::ops::Range<usize>, out: &mut [T]) {
    out.copy_from_slice(&slots[0][range.clone()]);
    for s in &slots[1..] {
        out.iter_mut()
            .zip(&s[range.clone()])
            .for_each(|(o, &x)| *o = o.add(x));
    }
}

/// The collectives over one element type; the `Comm` impl dispatches on the tag.
impl LocalComm {
    /// Counts a call over `full_bytes` that began at `t0` in this rank's stats.
    fn count(&self, kind: Kind, full_bytes: usize, t0: Instant) {
        record(&self.stats, kind, self.size(), full_bytes, t0);
    }

    /// In parts of [`ALL_REDUCE_PART`] elements: a rank's slot holds one
    /// part, not a copy of the whole buffer (ddp's gradient) that no
    /// memory count sees (an in-place all-reduce, as NCCL's and MPI's,
    /// holds none). Each element is summed in rank order as before.
    fn all_reduce_typed<T: CommElem>(&self, buf: &mut [T]) -> Result<()> {
        let t0 = Instant::now();
        let total = buf.len();
        for part in buf.chunks_mut(ALL_REDUCE_PART) {
            let n = part.len();
            self.group.deposit(self.rank, part, total);
            self.group.read_all(self.rank, "all_reduce", |slots| {
                sum_slots(slots, 0..n, part)
            })?;
        }
        self.count(Kind::AllReduce, size_of_val(buf), t0);
        Ok(())
    }

    fn reduce_scatter_typed<T: CommElem>(&self, input: &[T], out: &mut [T]) -> Result<()> {
        let t0 = Instant::now();
        let n = out.len();
        assert_eq!(input.len(), n * self.size(), "reduce_scatter sizes");
        let r = self.rank;
        self.group.exchange(r, "reduce_scatter", input, |slots| {
            sum_slots(slots, r * n..(r + 1) * n, out)
        })?;
        self.count(Kind::ReduceScatter, size_of_val(input), t0);
        Ok(())
    }

    fn all_gather_typed<T: CommElem>(&self, input: &[T], out: &mut [T]) -> Result<()> {
        let t0 = Instant::now();
        let n = input.len();
        assert_eq!(out.len(), n * self.size(), "all_gather sizes");
        self.group
            .exchange(self.rank, "all_gather", input, |slots| {
                for (i, s) in slots.iter().enumerate() {
                    out[i * n..(i + 1) * n].copy_from_slice(s);
                }
            })?;
        self.count(Kind::AllGather, size_of_val(out), t0);
        Ok(())
    }

    fn broadcast_typed<T: CommElem>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let t0 = Instant::now();
        let me = self.rank;
        let mine: &[T] = if me == root { buf } else { &[] };
        self.group.deposit(me, mine, buf.len());
        self.group.read_all(me, "broadcast", |slots| {
            if me != root {
                buf.copy_from_slice(slots[root])
            }
        })?;
        self.count(Kind::Broadcast, size_of_val(buf), t0);
        Ok(())
    }

    fn send_typed<T: CommElem>(&self, buf: &[T], to: usize) -> Result<()> {
        let t0 = Instant::now();
        let mut st = self.group.lock();
        st.mail
            .entry((self.rank, to))
            .or_default()
            .push_back((T::DTYPE, Box::new(buf.to_vec())));
        self.group.cv.notify_all();
        drop(st);
        self.count(Kind::P2p, size_of_val(buf), t0);
        Ok(())
    }

    fn recv_typed<T: CommElem>(&self, buf: &mut [T], from: usize) -> Result<()> {
        let key = (from, self.rank);
        let st = self.group.lock();
        let what = format!("recv from rank {}", self.group.members[from]);
        let mut st = self.group.wait_for(st, &what, from, |s| {
            s.mail.get(&key).is_some_and(|q| !q.is_empty())
        })?;
        let (dtype, msg) = st
            .mail
            .get_mut(&key)
            .and_then(VecDeque::pop_front)
            .expect("waited for it");
        let msg = msg.downcast::<Vec<T>>().map_err(|_| {
            Error::Comm(format!(
                "{what}: got {dtype} elements, expected {}",
                T::DTYPE
            ))
        })?;
        if msg.len() != buf.len() {
            return Err(Error::Comm(format!(
                "{what}: got {} {dtype} elements, expected {}",
                msg.len(),
                buf.len()
            )));
        }
        buf.copy_from_slice(&msg);
        Ok(())
    }
}

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.members.len()
    }

    fn shared_threads(&self) -> Option<usize> {
        self.shared_threads
    }

    fn failure(&self) -> Option<String> {
        let (r, why) = self.group.world.failure()?;
        Some(format!("rank {r} failed: {why}"))
    }

    crate::comm::elem::typed!(comm_methods);

    fn barrier(&self) -> Result<()> {
        self.group.sync(self.rank, "barrier")
    }

    fn barrier_after_io(&self) -> Result<()> {
        self.group
            .sync_within(self.rank, "barrier after writing files", None)
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Comm>> {
        let me = [color as u64, key as u64];
        let all: Vec<(usize, usize, usize)> =
            self.group.exchange(self.rank, "split", &me, |slots| {
                slots
                    .iter()
                    .enumerate()
                    .map(|(r, s)| (s[0] as usize, s[1] as usize, r))
                    .collect()
            })?;
        let mut mine: Vec<(usize, usize)> = all
            .iter()
            .filter(|x| x.0 == color)
            .map(|x| (x.1, x.2))
            .collect();
        mine.sort();
        let seq = {
            let mut st = self.group.lock();
            if mine[0].1 == self.rank {
                let members = mine.iter().map(|&(_, r)| self.group.members[r]).collect();
                let seq = st.splits;
                st.subgroups
                    .insert((seq, color), Group::new(members, self.group.world.clone()));
            }
            st.splits
        };
        self.group.sync(self.rank, "split")?;
        let sub = self.group.lock().subgroups[&(seq, color)].clone();
        self.group.sync(self.rank, "split")?;
        if mine[0].1 == self.rank {
            let mut st = self.group.lock();
            st.splits += 1;
        }
        let rank = mine
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("member of own color");
        Ok(Box::new(LocalComm {
            rank,
            group: sub,
            stats: Mutex::default(),
            shared_threads: self.shared_threads,
        }))
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Buf, BufMut};

    fn run<R: Send>(n: usize, f: impl Fn(&dyn Comm) -> R + Sync) -> Vec<R> {
        let (_, comms) = world(n, Duration::from_secs(10));
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Rank 0's value reaches every rank whole (a path in several
    /// scripts, the matmul libraries with and without a bf16 one), and
    /// every rank's value reaches every rank, f64s to the last bit.
    #[test]
    fn values_are_agreed_and_gathered_whole() {
        use crate::backend::cpu::blas::{MatmulChoice, MatmulLib::*};
        let path = std::path::PathBuf::from("/tmp/läufe/модель 模型 🚀/ckpt");
        for bf16 in [None, Some(Mkl)] {
            let choice = |r| match r {
                0 => MatmulChoice {
                    large: Blis,
                    small: OpenBlas,
                    bf16,
                },
                _ => MatmulChoice {
                    large: Gemm,
                    small: Gemm,
                    bf16: Some(Gemm),
                },
            };
            let out = run(3, |c| {
                let mine = match c.rank() {
                    0 => path.clone(),
                    _ => "elsewhere".into(),
                };
                (c.agree(mine).unwrap(), c.agree(choice(c.rank())).unwrap())
            });
            assert_eq!(out, vec![(path.clone(), choice(0)); 3]);
        }
        let mine = |r: usize| (vec![0.1 + 0.2, 5e-324, 1.0 / 3.0 + r as f64], "ü".repeat(r));
        let out = run(3, |c| c.gather(&mine(c.rank())).unwrap());
        assert_eq!(out, vec![(0..3).map(mine).collect::<Vec<_>>(); 3]);
    }

    /// A wait on another library's work (NCCL's, by polling) ends when it
    /// is done, with an error naming the rank when another thread rank
    /// fails, and with one naming the timeout when nothing comes: never
    /// a hang.
    #[test]
    fn a_polled_wait_ends_when_done_when_a_rank_fails_or_at_its_limit() {
        let (w, comms) = world(2, Duration::from_secs(10));
        let c: &dyn Comm = &comms[0];
        let never = || -> Result<bool> { Ok(false) };
        let mut asked = 0;
        let third = || -> Result<bool> {
            asked += 1;
            Ok(asked == 3)
        };
        let limit = Duration::from_secs(5);
        crate::comm::wait_until("ncclAllReduce", limit, third, || c.failure()).unwrap();
        assert_eq!(asked, 3);
        let start = Instant::now();
        let late =
            crate::comm::wait_until("ncclAllReduce", Duration::from_millis(30), never, || {
                c.failure()
            });
        let late = late.unwrap_err().to_string();
        assert!(late.contains("ncclAllReduce timed out after"), "{late}");
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        let broken = || -> Result<bool> { Err(Error::Device("an illegal address".into())) };
        let err = crate::comm::wait_until("ncclAllGather", limit, broken, || c.failure());
        assert!(err.unwrap_err().to_string().contains("an illegal address"));
        let start = Instant::now();
        let failing = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            w.fail(1, "out of memory".into());
        });
        let err = crate::comm::wait_until("ncclReduceScatter", limit, never, || c.failure());
        failing.join().unwrap();
        let err = err.unwrap_err().to_string();
        assert!(
            err.contains("ncclReduceScatter aborted: rank 1 failed: out of memory"),
            "{err}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }

    /// An all-reduce passes a buffer in parts: one rank's longer buffer
    /// is refused on every rank, not summed part by part with the other's
    /// next call (its last part met rank 1's one-float all-reduce alike).
    #[test]
    fn ranks_passing_buffers_of_other_lengths_are_refused() {
        let part = ALL_REDUCE_PART;
        let out = run(2, |c| {
            let mut buf = vec![1.0f32; 2 * part + 1 - c.rank()];
            let first = c.all_reduce(&mut buf).err().map(|e| e.to_string());
            let mut loss = [2.0f32];
            let next = c.all_reduce(&mut loss).err().map(|e| e.to_string());
            (first, next, buf.last().copied())
        });
        let said = format!("{out:?}");
        assert!(said.contains("other lengths"), "{said}");
        // the parts both ranks passed summed; then every rank refused
        for (first, next, _) in &out {
            assert!(first.is_some() || next.is_some(), "{said}");
        }
    }

    /// A step's small f64 all-reduce between large f32 collectives must not
    /// free the f32 buffer (it was refaulted every step).
    #[test]
    fn a_deposit_of_another_type_keeps_the_first_types_buffer() {
        let (w, _) = world(1, Duration::from_secs(10));
        let g = Group::new(vec![0], w);
        let ptr = |g: &Group| {
            g.lock().slots[0]
                .downcast_ref::<Vec<f32>>()
                .map(|v| v.as_ptr())
        };
        g.deposit(0, &vec![1.0f32; 1 << 20], 1 << 20);
        let first = ptr(&g).expect("an f32 slot");
        g.deposit(0, &[2.0f64], 1);
        assert!(ptr(&g).is_none());
        let kept = g.lock().kept[0]
            .get(&TypeId::of::<Vec<f32>>())
            .and_then(|v| v.downcast_ref::<Vec<f32>>())
            .map(|v| v.as_ptr());
        assert_eq!(kept, Some(first), "the f32 buffer was not kept");
        g.deposit(0, &vec![3.0f32; 1 << 20], 1 << 20);
        assert_eq!(ptr(&g), Some(first), "the f32 buffer was allocated anew");
    }

    /// Every collective over `T` on 3 ranks, against its definition.
    fn collectives_over<T: CommElem + From<u8>>() {
        let v = |x: usize| T::from(x as u8);
        let out = run(3, |c| {
            let r = c.rank();
            let mut a = vec![v(r), v(2 * r)];
            c.all_reduce(&mut a).unwrap();
            let input: Vec<T> = (0..6).map(|i| v(i + r)).collect();
            let mut rs = vec![T::default(); 2];
            c.reduce_scatter(&input, &mut rs).unwrap();
            let mut ag = vec![T::default(); 3];
            c.all_gather(&[v(r)], &mut ag).unwrap();
            let mut b = vec![v(r); 2];
            c.broadcast(&mut b, 2).unwrap();
            // A ring: each rank sends to the next and hears from the previous.
            c.send(&[v(r), v(10 + r)], (r + 1) % 3).unwrap();
            let mut got = vec![T::default(); 2];
            c.recv(&mut got, (r + 2) % 3).unwrap();
            (a, rs, ag, b, got)
        });
        for (r, (a, rs, ag, b, got)) in out.into_iter().enumerate() {
            let name = T::DTYPE;
            assert_eq!(a, [v(3), v(6)], "{name} all_reduce");
            let want: Vec<T> = (2 * r..2 * r + 2).map(|i| v(3 * i + 3)).collect();
            assert_eq!(rs, want, "{name} reduce_scatter");
            assert_eq!(ag, [v(0), v(1), v(2)], "{name} all_gather");
            assert_eq!(b, [v(2), v(2)], "{name} broadcast");
            let prev = (r + 2) % 3;
            assert_eq!(got, [v(prev), v(10 + prev)], "{name} send/recv");
        }
    }

    #[test]
    fn collectives_agree_with_their_definitions_for_every_dtype() {
        collectives_over::<f32>();
        collectives_over::<f64>();
        collectives_over::<u32>();
        collectives_over::<u64>();
        collectives_over::<i64>();
        collectives_over::<u8>();
    }

    #[test]
    fn a_u64_beyond_f32_precision_survives_every_collective() {
        const BIG: u64 = 123_456_789_012;
        // What the f32 collectives did to it: 123_456_790_528.
        assert_ne!(BIG as f32 as u64, BIG);
        let out = run(2, |c| {
            let r = c.rank() as u64;
            let mut sum = [BIG + r];
            c.all_reduce(&mut sum).unwrap();
            let mut all = [0u64; 2];
            c.all_gather(&[BIG + r], &mut all).unwrap();
            let mut b = [if r == 1 { BIG } else { 0 }];
            c.broadcast(&mut b, 1).unwrap();
            (sum[0], all, b[0])
        });
        for o in out {
            assert_eq!(o, (2 * BIG + 1, [BIG, BIG + 1], BIG));
        }
    }

    #[test]
    fn stats_count_bytes_of_the_element_type() {
        let (_, comms) = world(2, Duration::from_secs(10));
        let stats = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let d: &dyn Comm = c;
                        d.all_reduce(&mut [1u64; 3]).unwrap();
                        d.broadcast(&mut [7u8; 5], 0).unwrap();
                        c.stats()
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        // ring all-reduce over 2 ranks sends one buffer (24 bytes); a broadcast sends it whole
        assert_eq!(stats[0].all_reduce_bytes, 24);
        assert_eq!(stats[0].broadcast_bytes, 5);
    }

    #[test]
    fn a_message_or_buffer_of_another_type_is_an_error() {
        let out = run(2, |c| {
            if c.rank() == 0 {
                c.send(&[1u32], 1).unwrap();
            } else {
                let err = c.recv(&mut [0f32], 0).unwrap_err().to_string();
                assert!(err.contains("got u32 elements, expected f32"), "{err}");
            }
            let mut out = [0u32; 2];
            c.all_gather_buf(Buf::F32(&[1.0]), BufMut::U32(&mut out))
                .unwrap_err()
                .to_string()
        });
        assert!(
            out[0].contains("input holds f32 but output holds u32"),
            "{}",
            out[0]
        );
    }

    #[test]
    fn split_makes_independent_subgroups_and_p2p_works() {
        let out = run(4, |c| {
            let sub = c.split(c.rank() % 2, c.rank()).unwrap();
            let mut x = vec![c.rank() as f32];
            sub.all_reduce(&mut x).unwrap();
            if c.rank() == 0 {
                c.send(&[7.0f32, 8.0], 3).unwrap();
            }
            let mut got = vec![0.0f32; 2];
            if c.rank() == 3 {
                c.recv(&mut got, 0).unwrap();
            }
            (sub.rank(), sub.size(), x[0], got)
        });
        assert_eq!(out[0].0..=out[0].1, 0..=2);
        assert_eq!(out[0].2, 2.0); // ranks 0 + 2
        assert_eq!(out[1].2, 4.0); // ranks 1 + 3
        assert_eq!(out[3].3, vec![7.0, 8.0]);
    }

    #[test]
    fn a_failed_rank_is_named_by_the_others() {
        let (w, comms) = world(3, Duration::from_secs(30));
        let t0 = Instant::now();
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    let w = w.clone();
                    s.spawn(move || {
                        if c.rank() == 1 {
                            w.fail(1, "injected fault".into());
                            return String::new();
                        }
                        let c: &dyn Comm = c;
                        c.all_reduce(&mut [1.0f32]).unwrap_err().to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            errs[0].contains("rank 1 failed: injected fault"),
            "{}",
            errs[0]
        );
        assert!(errs[2].contains("rank 1"), "{}", errs[2]);
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_silent_rank_times_out_with_its_number() {
        let (_, comms) = world(2, Duration::from_millis(200));
        let mut x = vec![1.0f32];
        let c: &dyn Comm = &comms[0];
        let err = c.all_reduce(&mut x).unwrap_err().to_string();
        assert!(
            err.contains("timed out") && err.contains("rank(s) 1"),
            "{err}"
        );
        // a receive waits for its sender alone (it named every rank that
        // had not arrived at a rendezvous: "rank(s) 0, 1", itself too)
        let (_, comms) = world(3, Duration::from_millis(200));
        let c: &dyn Comm = &comms[2];
        let err = c.recv(&mut x, 1).unwrap_err().to_string();
        assert!(
            err.ends_with("recv from rank 1 timed out after 0 s waiting for rank(s) 1"),
            "{err}"
        );
    }
}
