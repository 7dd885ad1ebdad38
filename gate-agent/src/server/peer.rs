//! Who a probe or metrics connection comes from, for its slot. A peer elsewhere is its
//! address. A peer on the node (one that connects from the address it connects to) is not:
//! the kubelet and every host-network pod share the node's address, so a pod could hold that
//! address's slots and starve the kubelet's probes, and the kubelet would restart the agent.
//! There the kernel names the cgroup of the peer's socket (sock_diag), and only a cgroup
//! outside the gated root (the kubelet's, the runtime's) may take the reserve: what a
//! cgroup can tell and an address cannot.
use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use crate::{
    cgroup::{GatedRoot, Place},
    sockdiag::DiagSocket,
};

/// Whose slots a connection takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Caller {
    /// A peer elsewhere, or one on the node whose cgroup is not known.
    Address(IpAddr),
    /// A socket on the node, by its cgroup.
    Cgroup(u64),
}

/// A connection's caller, and whether it may take the reserve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Known {
    pub(crate) caller: Caller,
    /// A process of the node's own, outside the gated root.
    pub(crate) node: bool,
}

/// What the kernel tells about a peer on the node (a fake in the unit tests).
pub(crate) trait PeerKernel: Send {
    /// The cgroup id of the socket connected from `peer` to `local`, if the kernel names it.
    fn cgroup_of(&mut self, peer: SocketAddr, local: SocketAddr) -> Option<u64>;
    /// Where cgroup `id` lies: `Ok(None)` if no cgroup has it; `Err` if this way of asking is
    /// not open to the agent (no CAP_DAC_READ_SEARCH), so the caller walks instead.
    fn place_by_handle(&self, id: u64) -> io::Result<Option<Place>>;
    /// Every cgroup of the hierarchy with its place.
    fn places(&self) -> Vec<(u64, Place)>;
}

/// The running kernel: sock_diag in the agent's network namespace, and the cgroup tree.
pub(crate) struct HostKernel {
    root: GatedRoot,
    /// Opened at first use, and again after an error.
    diag: Option<DiagSocket>,
}

impl HostKernel {
    pub(crate) fn new(root: GatedRoot) -> HostKernel {
        HostKernel { root, diag: None }
    }
}

impl PeerKernel for HostKernel {
    fn cgroup_of(&mut self, peer: SocketAddr, local: SocketAddr) -> Option<u64> {
        let diag = match &mut self.diag {
            Some(d) => d,
            None => self.diag.insert(
                DiagSocket::open()
                    .inspect_err(|e| tracing::debug!(error = %e, "opening sock_diag"))
                    .ok()?,
            ),
        };
        match diag.cgroup_of(peer, local) {
            Ok(id) => id,
            Err(e) => {
                tracing::debug!(error = %e, %peer, "asking sock_diag for a peer's cgroup");
                self.diag = None;
                None
            }
        }
    }

    fn place_by_handle(&self, id: u64) -> io::Result<Option<Place>> {
        self.root.place_by_handle(id)
    }

    fn places(&self) -> Vec<(u64, Place)> {
        self.root.places()
    }
}

/// At most one walk of the cgroup tree per this long, however many unknown cgroups connect:
/// a pod that starts containers to make the agent walk gets one walk, and no reserve.
const WALK_EVERY: Duration = Duration::from_secs(5);
/// Places remembered: cgroup ids are never reused, so a place once seen stays true.
const PLACES: usize = 65_536;

/// The callers of the probe and metrics listeners, by what the kernel says of them.
pub(crate) struct Peers {
    kernel: Box<dyn PeerKernel>,
    places: HashMap<u64, Place>,
    walked: Option<Instant>,
}

/// Shared by the listeners, asked on a blocking thread.
pub(crate) type SharedPeers = Arc<Mutex<Peers>>;

impl Peers {
    pub(crate) fn new(kernel: Box<dyn PeerKernel>) -> SharedPeers {
        Arc::new(Mutex::new(Peers { kernel, places: HashMap::new(), walked: None }))
    }

    /// The caller of a connection accepted from `peer` on `local`. A peer on the node whose
    /// cgroup cannot be found (the lookup failed, the socket or its cgroup is gone, a walk was
    /// made too recently) shares its address's slots and gets no reserve. (The listeners ask
    /// through the free [`who`], which keeps the blocking part off the runtime.)
    #[cfg(test)]
    fn who(&mut self, peer: SocketAddr, local: SocketAddr) -> Known {
        match on_node(peer, local) {
            Ok(()) => self.who_on_node(peer, local),
            Err(by_address) => by_address,
        }
    }

    /// [`Self::who`] for a peer on the node.
    fn who_on_node(&mut self, peer: SocketAddr, local: SocketAddr) -> Known {
        let by_address = Known { caller: Caller::Address(peer.ip().to_canonical()), node: false };
        let Some(id) = self.kernel.cgroup_of(peer, local) else { return by_address };
        match self.place(id) {
            Some(place) => Known { caller: Caller::Cgroup(id), node: place == Place::Outside },
            None => by_address,
        }
    }

    fn place(&mut self, id: u64) -> Option<Place> {
        if let Some(p) = self.places.get(&id) {
            return Some(*p);
        }
        // Not permitted (no CAP_DAC_READ_SEARCH, as in the DaemonSet): walk.
        if let Ok(found) = self.kernel.place_by_handle(id) {
            if let Some(p) = found {
                if self.places.len() >= PLACES {
                    self.places.clear();
                }
                self.places.insert(id, p);
            }
            return found;
        }
        if self.walked.is_some_and(|t| t.elapsed() < WALK_EVERY) {
            return None;
        }
        self.walked = Some(Instant::now());
        self.places.clear();
        self.places.extend(self.kernel.places().into_iter().take(PLACES));
        self.places.get(&id).copied()
    }
}

/// `Ok` if `peer` connects from the address it connects to (the node itself); else the
/// caller it is, by its address.
fn on_node(peer: SocketAddr, local: SocketAddr) -> Result<(), Known> {
    let ip = peer.ip().to_canonical();
    if local.ip().to_canonical() == ip {
        Ok(())
    } else {
        Err(Known { caller: Caller::Address(ip), node: false })
    }
}

/// [`Peers::who`], with what blocks (sock_diag, a walk) on a blocking thread: only for a peer
/// on the node.
pub(crate) async fn who(peers: &SharedPeers, peer: SocketAddr, local: SocketAddr) -> Known {
    if let Err(by_address) = on_node(peer, local) {
        return by_address;
    }
    let peers = Arc::clone(peers);
    let by_address = Known { caller: Caller::Address(peer.ip().to_canonical()), node: false };
    tokio::task::spawn_blocking(move || {
        peers.lock().unwrap_or_else(PoisonError::into_inner).who_on_node(peer, local)
    })
    .await
    .unwrap_or(by_address)
}

/// Every socket one cgroup, at one place: for the listeners' tests.
#[cfg(test)]
pub(crate) struct OneCgroup(pub(crate) Place);

#[cfg(test)]
impl PeerKernel for OneCgroup {
    fn cgroup_of(&mut self, _: SocketAddr, _: SocketAddr) -> Option<u64> {
        Some(1)
    }
    fn place_by_handle(&self, _: u64) -> io::Result<Option<Place>> {
        Ok(Some(self.0))
    }
    fn places(&self) -> Vec<(u64, Place)> {
        vec![(1, self.0)]
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Cgroups by id, sockets by peer port; counts the walks.
    #[derive(Default)]
    struct Fake {
        cgroups: HashMap<u64, Place>,
        sockets: HashMap<u16, u64>,
        by_handle: bool,
        walks: Arc<AtomicUsize>,
    }

    impl PeerKernel for Fake {
        fn cgroup_of(&mut self, peer: SocketAddr, _: SocketAddr) -> Option<u64> {
            self.sockets.get(&peer.port()).copied()
        }
        fn place_by_handle(&self, id: u64) -> io::Result<Option<Place>> {
            if self.by_handle {
                Ok(self.cgroups.get(&id).copied())
            } else {
                Err(io::Error::from_raw_os_error(libc::EPERM))
            }
        }
        fn places(&self) -> Vec<(u64, Place)> {
            self.walks.fetch_add(1, Ordering::Relaxed);
            self.cgroups.iter().map(|(k, v)| (*k, *v)).collect()
        }
    }

    const NODE: &str = "10.0.0.5";
    const KUBELET: u64 = 7;
    const POD: u64 = 40;

    fn fake(by_handle: bool) -> (Peers, Arc<AtomicUsize>) {
        let walks = Arc::new(AtomicUsize::new(0));
        let f = Fake {
            cgroups: [(KUBELET, Place::Outside), (POD, Place::Below)].into(),
            // Port 1000: the kubelet's; 2000: a host-network pod's; 3000: a socket whose
            // cgroup is gone; 4000: no socket (closed already).
            sockets: [(1000, KUBELET), (2000, POD), (3000, 99)].into(),
            by_handle,
            walks: walks.clone(),
        };
        (Peers { kernel: Box::new(f), places: HashMap::new(), walked: None }, walks)
    }

    fn at(ip: &str, port: u16) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), port)
    }

    #[test]
    fn on_the_node_the_cgroup_decides_elsewhere_the_address() {
        for by_handle in [true, false] {
            let (mut p, _) = fake(by_handle);
            let local = at(NODE, 9750);
            let node = |id| Known { caller: Caller::Cgroup(id), node: true };
            assert_eq!(p.who(at(NODE, 1000), local), node(KUBELET), "{by_handle}");
            let pod = Known { caller: Caller::Cgroup(POD), node: false };
            assert_eq!(p.who(at(NODE, 2000), local), pod, "a host-network pod: no reserve");
            let address = Known { caller: Caller::Address(NODE.parse().unwrap()), node: false };
            assert_eq!(p.who(at(NODE, 3000), local), address, "a cgroup gone: no reserve");
            assert_eq!(p.who(at(NODE, 4000), local), address, "no socket: no reserve");
            // A pod-network pod (its own address), even with a socket the kernel would name.
            let other =
                Known { caller: Caller::Address("10.128.0.9".parse().unwrap()), node: false };
            assert_eq!(p.who(at("10.128.0.9", 1000), local), other);
        }
    }

    #[test]
    fn unknown_cgroups_cost_one_walk_per_period() {
        let (mut p, walks) = fake(false);
        let local = at(NODE, 9750);
        assert!(p.who(at(NODE, 1000), local).node);
        assert_eq!(walks.load(Ordering::Relaxed), 1);
        // Known now: no walk.
        assert!(p.who(at(NODE, 1000), local).node);
        // A gone cgroup asks for a walk; the period is not over.
        for _ in 0..100 {
            assert!(!p.who(at(NODE, 3000), local).node);
        }
        assert_eq!(walks.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn an_ipv4_peer_of_a_dual_stack_listener_is_on_the_node() {
        let (mut p, _) = fake(true);
        let local = at("::ffff:10.0.0.5", 9750);
        assert!(p.who(at("::ffff:10.0.0.5", 1000), local).node);
    }
}
