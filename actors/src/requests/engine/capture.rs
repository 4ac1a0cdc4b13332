//! Capture pools: the handle's calls to the router, which owns the capture registry (see
//! [`crate::actors::router`]).

use super::Engine;
use crate::actors::router::{RouterMsg, StreamFilter};
use crate::vocab::error::Error;
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::Runtime;

impl<R: Runtime> Engine<R> {
    /// Routes allocations for streams that `filter` accepts into the capture pool `id`
    /// (creating it, or adding a use to it) until [`Engine::end_allocate_to_pool`].
    #[doc(hidden)]
    pub async fn begin_allocate_to_pool(
        &self,
        id: PoolId,
        filter: StreamFilter<R>,
    ) -> Result<(), Error> {
        self.call_router(|reply| RouterMsg::Begin { id, filter, reply })?
            .recv_async()
            .await
            .map_err(|_| Error::Shutdown)?
    }

    /// Stops routing allocations into pool `id`.
    #[doc(hidden)]
    pub async fn end_allocate_to_pool(&self, id: PoolId) -> Result<(), Error> {
        self.call_router(|reply| RouterMsg::End { id, reply })?
            .recv_async()
            .await
            .map_err(|_| Error::Shutdown)?
    }

    /// Drops one use of pool `id`; once none is left, the next `empty_cache` frees it.
    #[doc(hidden)]
    pub async fn release_pool(&self, id: PoolId) -> Result<(), Error> {
        self.call_router(|reply| RouterMsg::Release { id, reply })?
            .recv_async()
            .await
            .map_err(|_| Error::Shutdown)?
    }
}
