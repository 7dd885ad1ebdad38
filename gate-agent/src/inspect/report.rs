//! `report`'s table: one line per workload and endpoint, with its owner and counts, then the
//! paths it asked the metadata proxy for, one line each.
use std::fmt::Write as _;

use crate::access::AccessRecord;

/// The records as a table.
pub(crate) fn render_table(records: &[AccessRecord], now_unix_ms: u64) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<48} {:<32} {:<16} {:>8} {:>8} {:>8} {:>8}  LAST SEEN",
        "WORKLOAD", "OWNER", "ENDPOINT", "ALLOWED", "DENIED", "AUDITED", "PROXIED"
    );
    for r in records {
        let owner = match (&r.identity.owner, &r.identity.service_account) {
            (Some(o), Some(sa)) => format!("{o} (sa {sa})"),
            (Some(o), None) => o.clone(),
            (None, Some(sa)) => format!("(sa {sa})"),
            (None, None) => "-".into(),
        };
        let ago = now_unix_ms.saturating_sub(r.last_seen_unix_ms) / 1000;
        let c = &r.counts;
        let _ = writeln!(
            o,
            "{:<48} {:<32} {:<16} {:>8} {:>8} {:>8} {:>8}  {ago}s ago",
            r.identity.workload, owner, r.endpoint, c.allowed, c.denied, c.audited, c.proxied
        );
        for p in &r.paths {
            let query =
                if p.query.is_empty() { String::new() } else { format!(" ?{}", p.query.join("&")) };
            let c = &p.counts;
            let limited = if c.limited > 0 {
                format!(", over the rate {}", c.limited)
            } else {
                String::new()
            };
            let _ = writeln!(
                o,
                "    {} {}{query}: served {}, refused {}, audited {}{limited}",
                p.method, p.path, c.served, c.refused, c.audited
            );
        }
    }
    if records.is_empty() {
        let _ = writeln!(o, "(no workload has touched a protected endpoint)");
    }
    o
}
