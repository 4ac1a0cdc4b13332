//! Who waits for a miss and how: a task awaits each reply; a thread outside the runtime's
//! executors blocks for it (by its deadline, if any), spinning a little before it parks, and
//! without a deadline runs the pool actor's memory-source calls.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::books::budget::Budget;
use crate::books::messages::{Answer, MissReply};
use crate::vocab::error::Error;

/// Who waits for a miss: a task, which awaits, or a thread, which blocks (and may run errands
/// to run the memory source's calls). The miss loop ([`miss_with`]) is written once over it:
/// a thread's waits are done by the time their futures are first polled, so
/// [`crate::vocab::blocking::run_here`] drives the request on the thread without an executor.
pub(super) trait Requester: Sync {
    /// Whether the requesting thread runs the memory source's calls for the pool actor
    /// ([`Ask::runs_errands`]): a task must not block its executor.
    fn runs_errands(&self) -> bool;
    /// The pool actor's answer to a miss.
    fn answer<B: Send>(
        &self,
        rx: &flume::Receiver<Answer<B>>,
    ) -> impl Future<Output = Result<MissReply<B>, Stop>> + Send;
    /// The answer, or `None` once `at` has passed without it (the ask stays with the pool).
    fn answer_until<B: Send>(
        &self,
        rx: &flume::Receiver<Answer<B>>,
        at: Instant,
    ) -> impl Future<Output = Result<Option<MissReply<B>>, Stop>> + Send;
    /// Whether it blocks its thread for replies (a thread) rather than awaiting them.
    fn blocks(&self) -> bool;
    /// Another actor's reply (an emptied cache's report, a lent block); `None` when it is gone.
    fn recv<T: Send>(&self, rx: &flume::Receiver<T>) -> impl Future<Output = Option<T>> + Send;
    /// Runs the free-memory callbacks: whether one of them freed something.
    fn free_memory(&self, budget: &Arc<Budget>) -> impl Future<Output = bool> + Send;
}

/// Why an answer did not come.
pub(super) enum Stop {
    /// The pool actor is gone.
    Shutdown,
    /// The request's deadline passed.
    TimedOut,
    /// The request was refused while it waited (see `long_wait`).
    Refused(Error),
}

/// A task: it awaits every reply.
pub(super) struct Task;

impl Requester for Task {
    fn runs_errands(&self) -> bool {
        false
    }

    async fn answer<B: Send>(&self, rx: &flume::Receiver<Answer<B>>) -> Result<MissReply<B>, Stop> {
        answer_async(rx).await.map_err(|_| Stop::Shutdown)
    }

    /// Without a tokio runtime to time it (the future polled by another executor), as
    /// `answer`.
    async fn answer_until<B: Send>(
        &self,
        rx: &flume::Receiver<Answer<B>>,
        at: Instant,
    ) -> Result<Option<MissReply<B>>, Stop> {
        if tokio::runtime::Handle::try_current().is_err() {
            return self.answer(rx).await.map(Some);
        }
        match tokio::time::timeout_at(at.into(), answer_async(rx)).await {
            Ok(reply) => reply.map(Some).map_err(|_| Stop::Shutdown),
            Err(_) => Ok(None),
        }
    }

    fn blocks(&self) -> bool {
        false
    }

    async fn recv<T: Send>(&self, rx: &flume::Receiver<T>) -> Option<T> {
        rx.recv_async().await.ok()
    }

    /// On a blocking thread of the tokio runtime (inline where there is none: the future is
    /// then not polled by a tokio executor).
    fn free_memory(&self, budget: &Arc<Budget>) -> impl Future<Output = bool> + Send {
        let budget = budget.clone();
        async move {
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => handle
                    .spawn_blocking(move || budget.free_memory.run())
                    .await
                    .unwrap_or(false),
                Err(_) => budget.free_memory.run(),
            }
        }
    }
}

/// A thread outside the runtime's executors: it blocks for every reply, until `deadline`.
/// Without a deadline it runs the pool actor's errands, and spins a little before it parks
/// (see [`recv_spinning`]); a request with a deadline keeps it: the memory source's calls,
/// whose length nobody knows, run elsewhere.
pub(super) struct Thread {
    pub(super) deadline: Option<Instant>,
}

impl Requester for Thread {
    fn runs_errands(&self) -> bool {
        self.deadline.is_none()
    }

    fn answer<B: Send>(
        &self,
        rx: &flume::Receiver<Answer<B>>,
    ) -> impl Future<Output = Result<MissReply<B>, Stop>> + Send {
        std::future::ready(match self.deadline {
            Some(at) => answer_by(rx, at).map_err(|e| match e {
                flume::RecvTimeoutError::Timeout => Stop::TimedOut,
                flume::RecvTimeoutError::Disconnected => Stop::Shutdown,
            }),
            None => recv_spinning(rx).map_err(|_| Stop::Shutdown),
        })
    }

    fn answer_until<B: Send>(
        &self,
        rx: &flume::Receiver<Answer<B>>,
        at: Instant,
    ) -> impl Future<Output = Result<Option<MissReply<B>>, Stop>> + Send {
        std::future::ready(match self.deadline {
            Some(deadline) if deadline <= at => self_deadline(answer_by(rx, deadline)),
            Some(_) => match answer_by(rx, at) {
                Err(flume::RecvTimeoutError::Timeout) => Ok(None),
                other => self_deadline(other),
            },
            None => recv_spinning_until(rx, Some(at)).map_err(|_| Stop::Shutdown),
        })
    }

    fn blocks(&self) -> bool {
        true
    }

    fn recv<T: Send>(&self, rx: &flume::Receiver<T>) -> impl Future<Output = Option<T>> + Send {
        std::future::ready(rx.recv().ok())
    }

    /// Here: a blocking miss runs on a thread that may block.
    fn free_memory(&self, budget: &Arc<Budget>) -> impl Future<Output = bool> + Send {
        std::future::ready(budget.free_memory.run())
    }
}

/// A thread's answer by its own deadline.
fn self_deadline<B>(
    r: Result<MissReply<B>, flume::RecvTimeoutError>,
) -> Result<Option<MissReply<B>>, Stop> {
    match r {
        Ok(reply) => Ok(Some(reply)),
        Err(flume::RecvTimeoutError::Timeout) => Err(Stop::TimedOut),
        Err(flume::RecvTimeoutError::Disconnected) => Err(Stop::Shutdown),
    }
}

/// How long a blocking miss spins on its reply before it parks the thread: long enough for
/// a pool actor that has to be woken first (the requester is blocked either way; polling
/// spares it a wake-up of its own).
const REPLY_SPIN: Duration = Duration::from_micros(200);

/// Waits for a pool actor's answer, polling for it for [`REPLY_SPIN`] before parking the
/// thread: a miss that the actor serves from memory it holds is answered within
/// microseconds, and parking would add a wake-up about as long as the wait itself. Errands
/// the actor sends meanwhile run here (see [`crate::books::errand`]), and the spin starts again
/// after each: the answer follows soon after the errand's result.
fn recv_spinning<B>(rx: &flume::Receiver<Answer<B>>) -> Result<MissReply<B>, flume::RecvError> {
    // Without a deadline, the answer or the end of the channel.
    recv_spinning_until(rx, None)?.ok_or(flume::RecvError::Disconnected)
}

/// [`recv_spinning`] until `until`: `None` once it has passed without an answer.
fn recv_spinning_until<B>(
    rx: &flume::Receiver<Answer<B>>,
    until: Option<Instant>,
) -> Result<Option<MissReply<B>>, flume::RecvError> {
    let mut start = Instant::now();
    loop {
        let answer = match rx.try_recv() {
            Ok(a) => a,
            Err(flume::TryRecvError::Disconnected) => return Err(flume::RecvError::Disconnected),
            Err(flume::TryRecvError::Empty) if start.elapsed() < REPLY_SPIN => {
                std::hint::spin_loop();
                continue;
            }
            Err(flume::TryRecvError::Empty) => match until {
                None => rx.recv()?,
                Some(at) => match rx.recv_deadline(at) {
                    Ok(a) => a,
                    Err(flume::RecvTimeoutError::Timeout) => return Ok(None),
                    Err(flume::RecvTimeoutError::Disconnected) => {
                        return Err(flume::RecvError::Disconnected)
                    }
                },
            },
        };
        match answer {
            Answer::Done(reply) => return Ok(Some(reply)),
            Answer::Errand(errand) => {
                errand.run();
                start = Instant::now();
            }
        }
    }
}

/// Waits for a pool actor's answer until `deadline`. Such a request does not lend its thread
/// (see [`Ask::runs_errands`]): an errand sent all the same runs on a blocking thread once dropped.
fn answer_by<B>(
    rx: &flume::Receiver<Answer<B>>,
    deadline: Instant,
) -> Result<MissReply<B>, flume::RecvTimeoutError> {
    loop {
        if let Some(reply) = rx.recv_deadline(deadline)?.into_reply() {
            return Ok(reply);
        }
    }
}

/// Waits for a pool actor's answer from a task. A task does not lend its thread (see
/// [`Ask::runs_errands`]); an errand sent all the same runs on a blocking thread once dropped.
async fn answer_async<B>(
    rx: &flume::Receiver<Answer<B>>,
) -> Result<MissReply<B>, flume::RecvError> {
    loop {
        if let Some(reply) = rx.recv_async().await?.into_reply() {
            return Ok(reply);
        }
    }
}

#[cfg(test)]
mod tests;
