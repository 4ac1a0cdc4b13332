//! Choosing the runtime from the public builder: [`Builder::cuda`] for the real GPU (typed
//! errors when there is none), [`Builder::best_available`] for the GPU when there is one and
//! the simulated runtime otherwise.
//!
//! Owns no state; it only turns [`CudaInitError`] into the crate's one [`Error`] type
//! (invariant 7: no panic without a driver, a typed error instead).

use std::sync::Arc;

use super::auto::AutoRuntime;
use super::error::CudaInitError;
use super::runtime::CudaRuntime;
use crate::config::Config;
use crate::{Builder, Error, Runtime};

impl From<CudaInitError> for Error {
    fn from(error: CudaInitError) -> Self {
        match error {
            CudaInitError::NoSuchDevice { ordinal, count } => {
                Error::NoSuchDevice { ordinal, count }
            }
            other => Error::DeviceUnavailable {
                message: other.to_string(),
            },
        }
    }
}

impl<R: Runtime> Builder<R> {
    /// Switches to the CUDA runtime of device `ordinal`, configured from the `PINPOOL_CONF`
    /// environment variable ([`Config::from_env`]), or from the configuration given with
    /// [`Builder::config`]; its `size_policy` applies too (unless [`Builder::policy`] is
    /// given).
    ///
    /// Like [`Builder::runtime`], this keeps the other settings. Never panics: without a
    /// driver it is [`Error::DeviceUnavailable`], without that device
    /// [`Error::NoSuchDevice`], and with a malformed `PINPOOL_CONF` [`Error::InvalidConfig`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use pinpool::{Error, PinnedAllocator};
    ///
    /// match PinnedAllocator::builder().cuda(0) {
    ///     Ok(builder) => {
    ///         let allocator = builder.build()?;
    ///         let buf = allocator.alloc(1 << 20).await?;
    ///         assert_eq!(buf.len(), 1 << 20);
    ///     }
    ///     Err(Error::DeviceUnavailable { message }) => println!("no GPU: {message}"),
    ///     Err(other) => return Err(other),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn cuda(self, ordinal: usize) -> Result<Builder<CudaRuntime>, Error> {
        let config = self.resolved_config()?;
        self.cuda_with_config(ordinal, config)
    }

    /// [`Builder::cuda`] with `config` instead of the environment's (or one given before):
    /// its pinning settings for the runtime, and its `size_policy` for the allocator.
    ///
    /// ```
    /// use pinpool::config::{Config, PinStrategy};
    /// use pinpool::PinnedAllocator;
    ///
    /// let config = Config::default().with_pin_method(PinStrategy::Register);
    /// if let Ok(builder) = PinnedAllocator::builder().cuda_with_config(0, config) {
    ///     # let _ = builder;
    ///     // builder.build() inside a tokio runtime
    /// }
    /// ```
    pub fn cuda_with_config(
        self,
        ordinal: usize,
        config: Config,
    ) -> Result<Builder<CudaRuntime>, Error> {
        let runtime = CudaRuntime::with_config(ordinal, config.clone())?;
        Ok(self.config(&config).runtime(Arc::new(runtime)))
    }

    /// Switches to the best runtime available: CUDA device `ordinal` when a driver and that
    /// device are present, the simulated runtime otherwise. The choice is logged (at `info`
    /// level, target `pinpool::cuda`) and can be read back from
    /// [`AutoRuntime::describe`] through `pool.runtime()`.
    ///
    /// Configured from `PINPOOL_CONF` (or the configuration given with [`Builder::config`]);
    /// a malformed one is [`Error::InvalidConfig`] on either runtime. Never panics, whatever
    /// the machine. Like [`Builder::runtime`], it keeps the other settings.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use pinpool::PinnedAllocator;
    ///
    /// let allocator = PinnedAllocator::builder().best_available(0)?.build()?;
    /// println!("{}", allocator.runtime().describe()); // "cuda device 0" or "sim (...)"
    /// let stream = allocator.runtime().new_stream()?;
    /// let mut buf = allocator.alloc(4096).await?;
    /// buf.fill(1);
    /// buf.record_stream(&stream)?;
    /// # Ok(()) }
    /// ```
    pub fn best_available(self, ordinal: usize) -> Result<Builder<AutoRuntime>, Error> {
        let config = self.resolved_config()?;
        let runtime = AutoRuntime::detect_with_config(ordinal, config.clone());
        Ok(self.config(&config).runtime(Arc::new(runtime)))
    }
}
