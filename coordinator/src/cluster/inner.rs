//! The remote executor's state that the tasks serving its layers share: below both
//! [`super::remote`] (which builds it) and `layer` (which serves a layer with it).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use charm_shared::expert::ExpertExecutor;

use super::workers::Shared;

/// What the task serving a layer needs.
#[derive(Debug)]
pub(super) struct Inner {
    pub(super) shared: Arc<Shared>,
    pub(super) local: Arc<dyn ExpertExecutor>,
    /// The MTP layers' experts run on `local` (it holds experts): drafts cost no round trip.
    pub(super) mtp_here: bool,
    /// Decoder layers; the MTP layers come after them.
    pub(super) main_layers: usize,
    pub(super) hidden: usize,
    pub(super) next_id: AtomicU64,
    pub(super) fallbacks: AtomicU64,
    pub(super) steps: AtomicU64,
}
