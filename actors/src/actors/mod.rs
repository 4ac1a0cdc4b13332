//! Layer 7, the actors: the event poller, the pool actor (misses, fresh memory, carving, the
//! arena, queue, books) and the router (captures and the routing table).

pub(crate) mod poller;
pub(crate) mod pool;
pub(crate) mod router;
