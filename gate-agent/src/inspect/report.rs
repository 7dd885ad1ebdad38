//! `report`'s table: one line per workload and endpoint, with its owner and counts.
use std::fmt::Write as _;

use crate::access::AccessRecord;

/// The records as a table.
pub(crate) fn render_table(records: &[AccessRecord], now_unix_ms: u64) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<48} {:<32} {:<16} {:>8} {:>8} {:>8}  LAST SEEN",
        "WORKLOAD", "OWNER", "ENDPOINT", "ALLOWED", "DENIED", "AUDITED"
    );
    for r in records {
        let owner = match (&r.identity.owner, &r.identity.service_account) {
            (Some(o), Some(sa)) => format!("{o} (sa {sa})"),
            (Some(o), None) => o.clone(),
            (None, Some(sa)) => format!("(sa {sa})"),
            (None, None) => "-".into(),
        };
        let ago = now_unix_ms.saturating_sub(r.last_seen_unix_ms) / 1000;
        let _ = writeln!(
            o,
            "{:<48} {:<32} {:<16} {:>8} {:>8} {:>8}  {ago}s ago",
            r.identity.workload,
            owner,
            r.endpoint,
            r.counts.allowed,
            r.counts.denied,
            r.counts.audited
        );
    }
    if records.is_empty() {
        let _ = writeln!(o, "(no workload has touched a protected endpoint)");
    }
    o
}
