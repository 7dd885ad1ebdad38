//! User-space views of the kernel ABI (feature `user`), so that the agent, `status` and the
//! tests spell every concept one way:
//!
//! * [`vocab`]: typed hooks, verdicts, modes, terminate states and attach points, each with
//!   the id the kernel stores, the name users read, and (for attach points) the program and
//!   pin names.
//! * [`pod`]: the `aya::Pod` impls of the map types and the one way raw bytes (ring buffer
//!   records, netlink replies) become plain-data structs.
//! * [`allow`]: the allow set as the kernel holds it, and the policy hash.
//! * `event`: a denial event's fields as users read them.
pub mod allow;
mod event;
pub mod pod;
pub mod vocab;

pub use allow::{AllowSet, PolicyHash};
pub use event::proto_name;
pub use pod::{bytes_of, read_pod};
pub use vocab::{AttachPoint, Hook, Mode, Program, TcDirection, TerminateState, Verdict};
