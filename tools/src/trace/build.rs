//! Builds a [`Trace`] from events one at a time, enforcing its invariants (dense ids, one
//! allocation per id, frees only of live ids) and deriving the lifetimes.

use super::{Lifetime, Trace, TraceErrorKind, TraceEvent};

/// How allocation ids must be numbered.
#[derive(Clone, Copy, Debug)]
pub(crate) enum IdRule {
    /// Each allocation takes the next id: 0, 1, 2, ... (the text format).
    InOrder,
    /// Any order, each id once, all below this count (CSV and [`Trace::from_events`]).
    DenseBelow(usize),
}

const UNFREED: u64 = u64::MAX;
const UNSEEN: u64 = u64::MAX;

pub(crate) struct Builder {
    rule: IdRule,
    events: Vec<TraceEvent>,
    lifetimes: Vec<Lifetime>,
    allocated: usize,
}

impl Builder {
    pub(crate) fn new(rule: IdRule) -> Builder {
        let lifetimes = match rule {
            IdRule::InOrder => Vec::new(),
            IdRule::DenseBelow(count) => (0..count)
                .map(|id| Lifetime {
                    id,
                    size: 0,
                    start: UNSEEN,
                    end: UNFREED,
                })
                .collect(),
        };
        Builder {
            rule,
            events: Vec::new(),
            lifetimes,
            allocated: 0,
        }
    }

    pub(crate) fn push(&mut self, event: TraceEvent) -> Result<(), TraceErrorKind> {
        let time = self.events.len() as u64;
        match event {
            TraceEvent::Alloc { id, bytes, .. } => {
                match self.rule {
                    IdRule::InOrder => {
                        if id < self.lifetimes.len() {
                            return Err(TraceErrorKind::DuplicateId { id });
                        }
                        if id != self.lifetimes.len() {
                            return Err(TraceErrorKind::OutOfOrderId {
                                id,
                                expected: self.lifetimes.len(),
                            });
                        }
                        self.lifetimes.push(Lifetime {
                            id,
                            size: bytes,
                            start: time,
                            end: UNFREED,
                        });
                    }
                    IdRule::DenseBelow(count) => {
                        let slot = self
                            .lifetimes
                            .get_mut(id)
                            .ok_or(TraceErrorKind::IdOutOfRange { id, count })?;
                        if slot.start != UNSEEN {
                            return Err(TraceErrorKind::DuplicateId { id });
                        }
                        slot.size = bytes;
                        slot.start = time;
                    }
                }
                self.allocated += 1;
            }
            TraceEvent::Free { id } => {
                let slot = self
                    .lifetimes
                    .get_mut(id)
                    .filter(|slot| slot.start != UNSEEN)
                    .ok_or(TraceErrorKind::FreeOfUnknownId { id })?;
                if slot.end != UNFREED {
                    return Err(TraceErrorKind::DoubleFree { id });
                }
                slot.end = time;
            }
        }
        self.events.push(event);
        Ok(())
    }

    /// Id ranges are checked on push, and `DenseBelow(n)` is only used with exactly `n`
    /// allocation events, so every slot is filled here.
    pub(crate) fn finish(mut self) -> Trace {
        let end = self.events.len() as u64;
        debug_assert_eq!(self.allocated, self.lifetimes.len());
        for lifetime in &mut self.lifetimes {
            if lifetime.end == UNFREED {
                lifetime.end = end;
            }
        }
        Trace {
            events: self.events,
            lifetimes: self.lifetimes,
        }
    }
}
