//! Free-memory callbacks: the handle's calls on the registry that the miss path runs (see
//! [`crate::observation::free_memory`]).

use super::Engine;
use crate::observation::free_memory::FreeMemoryCallback;
use crate::vocab::runtime::Runtime;

impl<R: Runtime> Engine<R> {
    /// Attaches `f`, which frees what memory it can and says whether it freed anything
    /// (PyTorch's `FreeMemoryCallback`). It runs when a request finds no cached block that
    /// fits and there is no room for fresh memory (the memory source or the cap is full),
    /// before the caches are emptied and the request fails with `OutOfMemory`; if it says it
    /// freed something, the request is tried again first. It runs on a blocking thread, at
    /// most once per request; a panic in it is caught and counted
    /// ([`Engine::free_memory_callback_panics`]), and counts as freeing nothing.
    #[doc(hidden)]
    pub fn attach_free_memory_callback(&self, f: FreeMemoryCallback) {
        self.default_pool().budget.free_memory.attach(f);
    }

    /// How many times a free-memory callback has been called.
    pub fn free_memory_callback_calls(&self) -> u64 {
        self.default_pool().budget.free_memory.calls()
    }

    /// How many free-memory callback calls panicked.
    #[doc(hidden)]
    pub fn free_memory_callback_panics(&self) -> u64 {
        self.default_pool().budget.free_memory.panics()
    }
}
