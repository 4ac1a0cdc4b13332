//! The [`Recorder`]: turns the allocation and free calls of one iteration into lifetimes to
//! plan. Time is the call index, as in a trace file's lifetimes.

use super::Lifetime;

/// A free the recorder cannot accept.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The id was never returned by [`Recorder::on_alloc`].
    #[error("free of unknown allocation id {id}")]
    UnknownId {
        /// The id.
        id: usize,
    },
    /// The id was already freed.
    #[error("allocation id {id} freed twice")]
    DoubleFree {
        /// The id.
        id: usize,
    },
}

const LIVE: u64 = u64::MAX;

/// Records one iteration's allocations and frees.
///
/// ```
/// use pinpool::plan::{RecordError, Recorder};
/// let mut recorder = Recorder::new();
/// let id = recorder.on_alloc(256);
/// recorder.on_free(id)?;
/// assert_eq!(recorder.on_free(id), Err(RecordError::DoubleFree { id }));
/// let lifetimes = recorder.finish();
/// assert_eq!((lifetimes[0].size, lifetimes[0].start, lifetimes[0].end), (256, 0, 1));
/// # Ok::<(), RecordError>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Recorder {
    clock: u64,
    lifetimes: Vec<Lifetime>,
}

impl Recorder {
    /// An empty recording.
    pub fn new() -> Recorder {
        Recorder::default()
    }

    /// Records an allocation of `size` bytes; returns its id (0, 1, 2, ... in call order).
    pub fn on_alloc(&mut self, size: u64) -> usize {
        let id = self.lifetimes.len();
        self.lifetimes.push(Lifetime {
            id,
            size,
            start: self.clock,
            end: LIVE,
        });
        self.clock += 1;
        id
    }

    /// Records the free of allocation `id`. A bad id changes nothing.
    pub fn on_free(&mut self, id: usize) -> Result<(), RecordError> {
        let lifetime = self
            .lifetimes
            .get_mut(id)
            .ok_or(RecordError::UnknownId { id })?;
        if lifetime.end != LIVE {
            return Err(RecordError::DoubleFree { id });
        }
        lifetime.end = self.clock;
        self.clock += 1;
        Ok(())
    }

    /// Number of allocations recorded.
    pub fn len(&self) -> usize {
        self.lifetimes.len()
    }

    /// Whether nothing was allocated.
    pub fn is_empty(&self) -> bool {
        self.lifetimes.is_empty()
    }

    /// The lifetimes, indexed by id; allocations never freed live to the end of the recording.
    pub fn finish(mut self) -> Vec<Lifetime> {
        for lifetime in &mut self.lifetimes {
            if lifetime.end == LIVE {
                lifetime.end = self.clock;
            }
        }
        self.lifetimes
    }
}
