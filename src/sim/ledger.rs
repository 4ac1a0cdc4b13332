//! The ledger actor: owns the registry of live host allocations and the violation log.
//!
//! One thread per runtime owns a `BTreeMap` from start address to allocation; everyone else
//! sends it messages over a flume channel and gets replies on one-shot channels. It keeps
//! "memory is given back exactly once": an allocation leaves the map in exactly one
//! `Remove`, so a double or foreign `host_free` is answered with an error and frees nothing.
//! The thread exits when the last sender (runtime, stream or worker) is dropped; any
//! allocation still registered then is released with the map.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::error::SimError;
use super::memory::HostAllocation;
use super::violation::Violation;

enum Msg {
    Register(Arc<HostAllocation>),
    Remove {
        addr: usize,
        size: usize,
        reply: flume::Sender<Option<Arc<HostAllocation>>>,
    },
    Find {
        addr: usize,
        size: usize,
        reply: flume::Sender<Option<Arc<HostAllocation>>>,
    },
    Lookup {
        addr: usize,
        len: usize,
        reply: flume::Sender<Option<Arc<HostAllocation>>>,
    },
    Report(Violation),
    Log {
        reply: flume::Sender<Vec<Violation>>,
    },
}

/// A handle to the ledger actor.
#[derive(Clone)]
pub(crate) struct Ledger {
    tx: flume::Sender<Msg>,
}

const THREAD: &str = "pinpool-sim-ledger";

impl Ledger {
    /// Starts the actor thread. If the OS cannot start it, every request is answered with
    /// [`SimError::ThreadGone`] (so `host_alloc` fails cleanly).
    pub(crate) fn spawn() -> Self {
        let (tx, rx) = flume::unbounded();
        if let Err(e) = std::thread::Builder::new()
            .name(THREAD.into())
            .spawn(move || run(rx))
        {
            tracing::error!(error = %e, "simulated runtime has no ledger thread");
        }
        Self { tx }
    }

    /// Registers a fresh allocation.
    pub(crate) fn register(&self, alloc: Arc<HostAllocation>) -> Result<(), SimError> {
        self.tx
            .send(Msg::Register(alloc))
            .map_err(|_| SimError::ThreadGone(THREAD))
    }

    /// Takes the allocation that starts at `addr` with exactly `size` bytes out of the
    /// registry, or `None` when there is none.
    pub(crate) fn remove(
        &self,
        addr: usize,
        size: usize,
    ) -> Result<Option<Arc<HostAllocation>>, SimError> {
        self.ask(|reply| Msg::Remove { addr, size, reply })
    }

    /// The live allocation that starts at `addr` with exactly `size` bytes, if any (left in
    /// the registry).
    pub(crate) fn find(
        &self,
        addr: usize,
        size: usize,
    ) -> Result<Option<Arc<HostAllocation>>, SimError> {
        self.ask(|reply| Msg::Find { addr, size, reply })
    }

    /// The live allocation containing `[addr, addr + len)`, if any.
    pub(crate) fn lookup(
        &self,
        addr: usize,
        len: usize,
    ) -> Result<Option<Arc<HostAllocation>>, SimError> {
        self.ask(|reply| Msg::Lookup { addr, len, reply })
    }

    /// Appends to the violation log.
    pub(crate) fn report(&self, violation: Violation) {
        // The log is diagnostics; a stopped ledger only loses the text (the count is kept
        // by the runtime's atomic counter).
        let _ = self.tx.send(Msg::Report(violation));
    }

    /// A copy of the violation log.
    pub(crate) fn log(&self) -> Result<Vec<Violation>, SimError> {
        self.ask(|reply| Msg::Log { reply })
    }

    fn ask<T>(&self, msg: impl FnOnce(flume::Sender<T>) -> Msg) -> Result<T, SimError> {
        let (reply, answer) = flume::bounded(1);
        self.tx
            .send(msg(reply))
            .map_err(|_| SimError::ThreadGone(THREAD))?;
        answer.recv().map_err(|_| SimError::ThreadGone(THREAD))
    }
}

fn run(rx: flume::Receiver<Msg>) {
    let mut live: BTreeMap<usize, Arc<HostAllocation>> = BTreeMap::new();
    let mut log: Vec<Violation> = Vec::new();
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Register(alloc) => {
                live.insert(alloc.addr(), alloc);
            }
            Msg::Remove { addr, size, reply } => {
                let found = match live.get(&addr) {
                    Some(a) if a.size() == size => live.remove(&addr),
                    _ => None,
                };
                let _ = reply.send(found);
            }
            Msg::Find { addr, size, reply } => {
                let found = live.get(&addr).filter(|a| a.size() == size).cloned();
                let _ = reply.send(found);
            }
            Msg::Lookup { addr, len, reply } => {
                let found = live
                    .range(..=addr)
                    .next_back()
                    .filter(|(_, a)| a.contains(addr, len))
                    .map(|(_, a)| Arc::clone(a));
                let _ = reply.send(found);
            }
            Msg::Report(v) => log.push(v),
            Msg::Log { reply } => {
                let _ = reply.send(log.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remove_gives_an_allocation_back_exactly_once() {
        let ledger = Ledger::spawn();
        let a = Arc::new(HostAllocation::new(64).unwrap());
        let (addr, size) = (a.addr(), a.size());
        ledger.register(a).unwrap();
        assert!(ledger.remove(addr, size).unwrap().is_some());
        assert!(ledger.remove(addr, size).unwrap().is_none());
    }

    #[test]
    fn remove_with_wrong_size_or_interior_address_finds_nothing() {
        let ledger = Ledger::spawn();
        let a = Arc::new(HostAllocation::new(64).unwrap());
        let (addr, size) = (a.addr(), a.size());
        ledger.register(a).unwrap();
        assert!(ledger.remove(addr, size + 1).unwrap().is_none());
        assert!(ledger.remove(addr + 1, size - 1).unwrap().is_none());
        assert!(ledger.remove(addr, size).unwrap().is_some());
    }

    #[test]
    fn lookup_finds_interior_ranges_only_within_bounds() {
        let ledger = Ledger::spawn();
        let a = Arc::new(HostAllocation::new(64).unwrap());
        let addr = a.addr();
        ledger.register(a).unwrap();
        assert!(ledger.lookup(addr + 10, 54).unwrap().is_some());
        assert!(ledger.lookup(addr + 10, 55).unwrap().is_none());
        assert!(ledger.lookup(addr + 64, 1).unwrap().is_none());
    }
}
