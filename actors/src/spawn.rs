//! Spawning actors as named tokio tasks, so that tokio-console shows them by name.
//!
//! Task names need `tokio::task::Builder`, which exists only under `--cfg tokio_unstable`;
//! without it, actors are plain `spawn`ed tasks.

use std::future::Future;

/// Spawns `fut` on `handle`, named `name` where the build supports task names.
pub(crate) fn spawn_named<F>(name: &str, handle: &tokio::runtime::Handle, fut: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    #[cfg(tokio_unstable)]
    {
        match tokio::task::Builder::new().name(name).spawn_on(fut, handle) {
            Ok(_) => {}
            Err(e) => tracing::error!(error = %e, task = name, "could not spawn actor"),
        }
    }
    #[cfg(not(tokio_unstable))]
    {
        let _ = name;
        handle.spawn(fut);
    }
}
