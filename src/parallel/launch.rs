//! Starting ranks: N threads of this process over `comm::local`, each with
//! its own share of the cores, or this process's rank under mpirun (MPI,
//! and NCCL on its GPU). A thread rank that errors or panics marks the
//! world failed, so the others stop with an error naming it.

use crate::comm::local;
use crate::comm::Comm;
use crate::error::{Error, Result};
use std::time::Duration;

/// How the ranks run (`--comm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CommKind {
    /// Ranks are threads of this process.
    Local,
    /// Ranks are processes started by mpirun (Open MPI).
    Mpi,
    /// One rank per GPU (--device cuda), NCCL for GPU buffers: thread
    /// ranks here (--features cuda), or processes under mpirun with MPI for
    /// what is on the host (--features mpi,cuda).
    Nccl,
}

crate::display_as_flag!(CommKind);

/// Where and how a command's ranks start.
pub struct Launch {
    pub comm: CommKind,
    /// Thread ranks to start, sharing this pool's threads (under mpirun,
    /// mpirun's processes are the ranks).
    pub world_size: usize,
    /// How long a collective may wait for the other ranks.
    pub timeout: Duration,
    /// The first GPU with --device cuda (None on another device).
    pub cuda_device: Option<usize>,
}

impl Launch {
    /// Runs `f` on every rank: threads here, or this process's rank under
    /// mpirun (on its GPU with [`CommKind::Nccl`]). Returns rank 0's result
    /// (None on the other MPI ranks).
    pub fn run<R: Send>(&self, f: impl Fn(&dyn Comm) -> Result<R> + Sync) -> Result<Option<R>> {
        match self.comm {
            CommKind::Local => self.threads_of(|c| f(c.as_ref())),
            CommKind::Mpi => mpi_launch(self.timeout, f),
            CommKind::Nccl => self.nccl(f),
        }
    }

    /// Rank 0's result of `f` on `world_size` thread ranks.
    fn threads_of<R: Send>(
        &self,
        f: impl Fn(Box<dyn Comm>) -> Result<R> + Sync,
    ) -> Result<Option<R>> {
        let threads = rayon::current_num_threads();
        let mut out = run_local(self.world_size, threads, self.timeout, f)?;
        Ok(Some(out.swap_remove(0)))
    }

    /// `--comm nccl`: under mpirun the MPI ranks, one process per GPU;
    /// otherwise `world_size` thread ranks, rank r on GPU `cuda_device` + r,
    /// their NCCL id shared through the thread group.
    #[cfg(feature = "cuda")]
    fn nccl<R: Send>(&self, f: impl Fn(&dyn Comm) -> Result<R> + Sync) -> Result<Option<R>> {
        let Some(base) = self.cuda_device else {
            return Err(Error::Config(
                "--comm nccl moves GPU buffers: it needs --device cuda".into(),
            ));
        };
        if under_mpirun() {
            return nccl_mpi_launch(self.timeout, base, f);
        }
        self.threads_of(|c| {
            let gpu = cuda_device_of(base, c.rank())?;
            f(&crate::comm::nccl::NcclComm::new(c, gpu, self.timeout)?)
        })
    }

    #[cfg(not(feature = "cuda"))]
    fn nccl<R: Send>(&self, _: impl Fn(&dyn Comm) -> Result<R> + Sync) -> Result<Option<R>> {
        Err(Error::Config("--comm nccl needs a build with CUDA: `cargo build --release --features cuda` (and `mpi` for mpirun)".into()))
    }
}

/// This process's rank of mpirun's world: rank 0's result of `f`, None on
/// the others; a failed rank stops the job.
#[cfg(feature = "mpi")]
fn mpi_launch<R>(timeout: Duration, f: impl Fn(&dyn Comm) -> Result<R>) -> Result<Option<R>> {
    let comm = crate::comm::mpi::MpiComm::init(timeout)?;
    match caught(comm.rank(), || f(&comm)) {
        Ok(r) => Ok((comm.rank() == 0).then_some(r)),
        Err(e) => comm.abort(&e.to_string()),
    }
}

/// `f`, where a panic is an error naming `rank` and the panic's message:
/// the other ranks are told (a thread group's mark, MPI_Abort), where
/// unwinding out would leave them waiting in a collective until their
/// timeout (an MPI rank's finalize waits for them).
fn caught<R>(rank: usize, f: impl FnOnce() -> Result<R>) -> Result<R> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let why = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
        Err(Error::Comm(format!(
            "rank {rank} panicked: {}",
            why.unwrap_or_default()
        )))
    })
}

#[cfg(not(feature = "mpi"))]
fn mpi_launch<R>(_: Duration, _: impl Fn(&dyn Comm) -> Result<R>) -> Result<Option<R>> {
    Err(Error::Config("this distgpt was built without MPI: rebuild with `cargo build --release --features mpi` (needs libopenmpi-dev and libclang-dev)".into()))
}

/// As `mpi_launch`, with an NCCL group over the MPI ranks on this rank's
/// GPU (`base` plus its local rank).
#[cfg(all(feature = "mpi", feature = "cuda"))]
fn nccl_mpi_launch<R>(
    timeout: Duration,
    base: usize,
    f: impl Fn(&dyn Comm) -> Result<R>,
) -> Result<Option<R>> {
    let comm = crate::comm::mpi::MpiComm::init(timeout)?;
    let group = rank_gpu(base)
        .and_then(|gpu| crate::comm::nccl::NcclComm::new(comm.split(0, comm.rank())?, gpu, timeout))
        .unwrap_or_else(|e| comm.abort(&e.to_string()));
    match caught(comm.rank(), || f(&group)) {
        Ok(r) => Ok((comm.rank() == 0).then_some(r)),
        Err(e) => comm.abort(&e.to_string()),
    }
}

#[cfg(all(feature = "cuda", not(feature = "mpi")))]
fn nccl_mpi_launch<R>(
    _: Duration,
    _: usize,
    _: impl Fn(&dyn Comm) -> Result<R>,
) -> Result<Option<R>> {
    Err(Error::Config("--comm nccl under mpirun needs a build with MPI: `cargo build --release --features mpi,cuda`".into()))
}

/// How many processes mpirun started, where it says (Open MPI's or
/// MPICH's count; None outside mpirun).
pub fn mpi_processes() -> Option<usize> {
    env_count(&["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
}

/// The first of `keys` the environment holds as a number.
fn env_count(keys: &[&str]) -> Option<usize> {
    keys.iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
}

/// The CPUs this process may run on (its affinity and quota).
pub fn available_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// What `world` processes of mpirun on CPUs add up to, in peaks of this
/// process's threads: each machine's processes (Open MPI's
/// `OMPI_COMM_WORLD_LOCAL_SIZE`, MPICH's `MPI_LOCALNRANKS`; without them,
/// one a machine) run on as many of its CPUs as they have threads, at
/// most all of them. mpirun binds two processes to a core each and more
/// to a socket, or to nothing: processes then share CPUs, and their peak.
/// Machines are taken to be alike.
pub fn cpu_process_shares(world: usize) -> f64 {
    let local = env_count(&["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]).unwrap_or(1);
    let mine = available_cpus();
    // SAFETY: sysconf reads a value; -1 (unknown) is handled below.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let machine = usize::try_from(online).unwrap_or(mine).max(mine);
    process_shares(
        world,
        local,
        rayon::current_num_threads().min(mine),
        machine,
    )
}

/// [`cpu_process_shares`] of `world` processes, `local` a machine, each on
/// `threads` of a machine's `cpus`.
fn process_shares(world: usize, local: usize, threads: usize, cpus: usize) -> f64 {
    let (local, threads) = (local.clamp(1, world.max(1)), threads.max(1));
    let machine = (local * threads).min(cpus.max(threads)) as f64 / threads as f64;
    world as f64 / local as f64 * machine
}

/// Refuses `distgpt command` in one of several processes mpirun started,
/// unless those processes are its ranks (`comm` MPI or NCCL; None: a
/// command without ranks): each would run all of it, into the same files.
pub fn refuse_copies(command: &str, comm: Option<CommKind>) -> Result<()> {
    let Some(n) = mpi_processes().filter(|&n| n > 1) else {
        return Ok(());
    };
    let why = format!(
        "mpirun started {n} processes of `distgpt {command}`, and each would run all of it, \
         into the same files"
    );
    match comm {
        Some(CommKind::Local) => Err(Error::Config(format!(
            "{why}: add --comm mpi to make each process one rank, or run it without mpirun"
        ))),
        None => Err(Error::Config(format!(
            "{why}: it runs as one process; run it without mpirun"
        ))),
        Some(_) => Ok(()),
    }
}

/// Whether this process is one of mpirun's (Open MPI, MPICH or PMIx).
pub fn under_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|k| std::env::var_os(k).is_some())
}

/// The GPU of this process: `base` plus its local rank under mpirun (Open
/// MPI's, MPICH's or Slurm's), wrapping around the GPUs there are; `base`
/// outside mpirun.
#[cfg(feature = "cuda")]
pub fn rank_gpu(base: usize) -> Result<usize> {
    let local = [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.parse::<usize>().ok());
    match local {
        Some(local) => cuda_device_of(base, local),
        None => Ok(base),
    }
}

/// Rank `rank`'s GPU counting from `base` (`Runtime::device_of`).
#[cfg(feature = "cuda")]
fn cuda_device_of(base: usize, rank: usize) -> Result<usize> {
    use crate::backend::gpu::Runtime;
    crate::backend::cuda::CudaRuntime::device_of(base, rank).map_err(|e| Error::Device(e.0))
}

/// The worker threads each of `n` thread ranks gets of `threads`.
pub fn rank_threads(threads: usize, n: usize) -> usize {
    (threads / n.max(1)).max(1)
}

/// The worker threads `n` thread ranks of `threads` run on in all (at
/// least one each): what they share, and what their peak is measured on.
pub fn ranks_threads(threads: usize, n: usize) -> usize {
    rank_threads(threads, n) * n
}

/// Runs `f` on a pool of `threads` worker threads, the caller's own where
/// it has as many: a probe of all thread ranks' threads runs on as many as
/// they do (`sharing_threads`).
pub fn with_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> Result<R> {
    if threads == rayon::current_num_threads() {
        return Ok(f());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::Config(format!("a pool of {threads} threads: {e}")))?;
    Ok(pool.install(f))
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
    let (per_rank, all) = (rank_threads(threads, n), ranks_threads(threads, n));
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
                    let out = caught(rank, || {
                        pool.install(|| f(Box::new(comm.sharing_threads(all))))
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
    // Report the rank that failed rather than the peers that noticed it.
    let (ok, failed): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
    let mut errs: Vec<Error> = failed.into_iter().filter_map(Result::err).collect();
    let origin = errs
        .iter()
        .rposition(|e| !e.to_string().contains("aborted: rank"));
    match errs.is_empty() {
        true => Ok(ok.into_iter().flatten().collect()),
        false => Err(errs.swap_remove(origin.unwrap_or(0))),
    }
}

#[cfg(test)]
mod tests {
    use super::process_shares;

    /// Processes of one machine share its CPUs: their peak is that of the
    /// CPUs their threads can use, in units of one process's threads (4
    /// processes of 2 threads on 2 CPUs were stated at 4 times one's peak).
    #[test]
    fn processes_sharing_cpus_share_their_peak() {
        // (world, a machine's, threads each, a machine's CPUs) -> shares
        for (case, want) in [
            ((2, 2, 1, 2), 2.0),  // bound to a core each
            ((2, 2, 2, 2), 1.0),  // bound to nothing: both on both CPUs
            ((4, 4, 2, 2), 1.0),  // bound to the socket
            ((4, 4, 1, 2), 2.0),  // --threads 1: two CPUs' worth
            ((8, 4, 4, 16), 8.0), // two machines, no CPU shared
            ((4, 1, 2, 2), 4.0),  // a process a machine
        ] {
            let (world, local, threads, cpus) = case;
            assert_eq!(
                process_shares(world, local, threads, cpus),
                want,
                "{case:?}"
            );
        }
    }
}
