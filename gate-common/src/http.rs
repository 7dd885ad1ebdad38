//! What the metadata proxy may serve, decided without I/O: the paths an allow entry lists, and
//! the request a workload sent, read strictly (host only).
//!
//! A [`PathRule`] is an exact path (`/latest/meta-data/instance-id`) or a whole-segment prefix,
//! written with a trailing `/` (`/latest/meta-data/placement/` covers `…/placement/region`,
//! never `…/placementX`). A leading `=` makes any path exact, one ending in `/` too: `=/`
//! is the metadata server's root alone (GCE's detection probe), never the paths below it.
//! A [`Target`] is a request's target in origin form, refused when it
//! could mean two things to two parsers: dot segments, `//`, backslashes, any percent-encoding
//! in the path, fragments, duplicate query keys, bytes outside printable ASCII. Whatever is
//! refused here (or, in a path rule, rejected) never reaches the metadata service; nothing
//! that a refused form could stand for is ever served.
use core::fmt;

/// Longest path or target accepted (metadata paths are short; a long one is an attack).
pub const MAX_TARGET: usize = 2048;

/// Why a path rule is rejected or a request target refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathError {
    /// Empty, or not starting with `/` (absolute-form `http://host/…`, authority-form, `*`).
    NotOriginForm,
    TooLong,
    /// A byte outside printable ASCII, or a space.
    Byte(u8),
    /// `%`: percent-encoding in a path (`%2f`, `%2e`) is not allowed, never decoded.
    PercentEncoded,
    Backslash,
    /// An empty segment: `//`.
    EmptySegment,
    /// A `.` or `..` segment.
    DotSegment,
    /// `#` in a request target.
    Fragment,
    /// `?` in a path rule (query parameters are listed apart).
    Query,
    /// A query parameter with an empty name, or a byte not allowed in a parameter.
    QueryParameter,
    /// The same query parameter twice.
    DuplicateParameter,
    /// A path rule's `=` (exact) not followed by a path starting with `/`.
    Exact,
}

impl fmt::Display for PathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathError::NotOriginForm => f.write_str("must start with /"),
            PathError::TooLong => write!(f, "longer than {MAX_TARGET} bytes"),
            PathError::Byte(b) => write!(f, "byte 0x{b:02x} is not printable ASCII"),
            PathError::PercentEncoded => f.write_str("percent-encoding (%) is not allowed"),
            PathError::Backslash => f.write_str("backslash is not allowed"),
            PathError::EmptySegment => f.write_str("empty segment (//)"),
            PathError::DotSegment => f.write_str(". and .. segments are not allowed"),
            PathError::Fragment => f.write_str("# is not allowed"),
            PathError::Query => f.write_str("? is not allowed here: list query parameters apart"),
            PathError::QueryParameter => f.write_str("malformed query parameter"),
            PathError::DuplicateParameter => f.write_str("query parameter given twice"),
            PathError::Exact => {
                f.write_str("= (an exact path) must be followed by a path starting with /")
            }
        }
    }
}

impl std::error::Error for PathError {}

/// Check a path: origin form, printable ASCII, no `%`, `\`, `//`, `.` or `..` segment. A
/// trailing `/` (an empty last segment) is allowed: it names a directory.
fn check_path(path: &str) -> Result<(), PathError> {
    if !path.starts_with('/') {
        return Err(PathError::NotOriginForm);
    }
    if path.len() > MAX_TARGET {
        return Err(PathError::TooLong);
    }
    if let Some(&b) = path.as_bytes().iter().find(|b| !(0x21..0x7f).contains(*b)) {
        return Err(PathError::Byte(b));
    }
    if path.contains('%') {
        return Err(PathError::PercentEncoded);
    }
    if path.contains('\\') {
        return Err(PathError::Backslash);
    }
    if path.contains('#') {
        return Err(PathError::Fragment);
    }
    if path.contains('?') {
        return Err(PathError::Query);
    }
    let segments: Vec<&str> = path[1..].split('/').collect();
    let last = segments.len() - 1;
    for (i, s) in segments.iter().enumerate() {
        match *s {
            "" if i < last => return Err(PathError::EmptySegment),
            "." | ".." => return Err(PathError::DotSegment),
            _ => {}
        }
    }
    Ok(())
}

/// The mark before a path that makes a rule exact whatever the path ends with (`=/`).
///
/// A leading `=` (as nginx's `location = /`): no path can start with it, so every rule
/// written before it keeps its meaning, and it reads as "equal to" where it stands.
pub const EXACT: char = '=';

/// One path an allow entry may read.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PathRule {
    /// As written, one spelling per rule: `=` before an exact path that ends with `/`
    /// (`=/a` means `/a`, and is kept as that); ends with `/` (no `=`) for a prefix rule.
    text: String,
}

impl PathRule {
    /// A path (exact, or a prefix when it ends with `/`), or `=` and a path (exact).
    pub fn parse(rule: &str) -> Result<PathRule, PathError> {
        let Some(path) = rule.strip_prefix(EXACT) else {
            check_path(rule)?;
            return Ok(PathRule { text: rule.to_owned() });
        };
        check_path(path).map_err(|e| match e {
            PathError::NotOriginForm => PathError::Exact,
            e => e,
        })?;
        let text = if path.ends_with('/') { rule.to_owned() } else { path.to_owned() };
        Ok(PathRule { text })
    }

    /// Whether it covers a whole subtree (written with a trailing `/` and no `=`).
    pub fn is_prefix(&self) -> bool {
        !self.text.starts_with(EXACT) && self.text.ends_with('/')
    }

    /// The rule as written (a path, or `=` and a path): what a policy says and its hash reads.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The path it names, without the `=` of an exact rule.
    pub fn path(&self) -> &str {
        self.text.strip_prefix(EXACT).unwrap_or(&self.text)
    }

    /// Whether some path is covered by both rules (`check` asks it of a listed rule and a
    /// sensitive one: `/latest/meta-data/` reaches `/latest/meta-data/iam/`, and so does
    /// `/latest/meta-data/iam/info`; `=/computeMetadata/v1/` reaches nothing below it).
    pub fn overlaps(&self, other: &PathRule) -> bool {
        match (self.is_prefix(), other.is_prefix()) {
            (false, _) => other.matches(self.path()),
            (true, false) => self.matches(other.path()),
            (true, true) => {
                self.text.starts_with(&other.text) || other.text.starts_with(&self.text)
            }
        }
    }

    /// Whether it covers `path` (a checked [`Target`]'s path): the same path; or, for a
    /// prefix rule, the directory itself (with or without its `/`) or anything below it.
    pub fn matches(&self, path: &str) -> bool {
        if !self.is_prefix() {
            return path == self.path();
        }
        path.starts_with(&self.text) || path == &self.text[..self.text.len() - 1]
    }
}

impl fmt::Display for PathRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A request target, checked: its path and its query parameters, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target<'a> {
    pub path: &'a str,
    pub query: Vec<(&'a str, &'a str)>,
}

/// A byte a query parameter name or value may hold: unreserved characters and a few
/// delimiters metadata APIs use in values (`2021-02-01`, `json`, `text`); no `%`.
/// Whether `name` may be listed as a query parameter: what [`Target::parse`] accepts as one.
pub fn is_parameter_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(query_byte)
}

fn query_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b':' | b',')
}

impl<'a> Target<'a> {
    /// Read the request target of an HTTP request line (origin form only).
    pub fn parse(target: &'a str) -> Result<Target<'a>, PathError> {
        if target.len() > MAX_TARGET {
            return Err(PathError::TooLong);
        }
        if target.contains('#') {
            return Err(PathError::Fragment);
        }
        let (path, query) = match target.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (target, None),
        };
        check_path(path)?;
        let mut params: Vec<(&str, &str)> = Vec::new();
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if k.is_empty() || !k.bytes().all(query_byte) || !v.bytes().all(query_byte) {
                return Err(PathError::QueryParameter);
            }
            if params.iter().any(|(seen, _)| *seen == k) {
                return Err(PathError::DuplicateParameter);
            }
            params.push((k, v));
        }
        Ok(Target { path, query: params })
    }
}

/// HTTP methods an entry may use. GET and HEAD unless it says more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Methods(u8);

impl Methods {
    pub const GET: Methods = Methods(1);
    pub const HEAD: Methods = Methods(2);
    /// IMDSv2's token request (`PUT /latest/api/token`).
    pub const PUT: Methods = Methods(4);
    pub const READ: Methods = Methods(1 | 2);

    /// The bit of a method by name (case-sensitive, as HTTP methods are); `None` for methods
    /// a metadata client never needs (POST, CONNECT, …).
    pub fn parse(name: &str) -> Option<Methods> {
        Methods::NAMES.into_iter().find(|(n, _)| *n == name).map(|(_, m)| m)
    }

    /// Every method an entry may list, by name, in the order they are printed.
    pub const NAMES: [(&'static str, Methods); 3] =
        [("GET", Methods::GET), ("HEAD", Methods::HEAD), ("PUT", Methods::PUT)];

    /// No method at all (an empty set to build on with [`Methods::union`]).
    pub const NONE: Methods = Methods(0);

    /// The names of the methods in the set.
    pub fn names(self) -> impl Iterator<Item = &'static str> {
        Methods::NAMES.into_iter().filter(move |(_, m)| self.contains(*m)).map(|(n, _)| n)
    }

    pub fn union(self, other: Methods) -> Methods {
        Methods(self.0 | other.0)
    }

    pub fn contains(self, other: Methods) -> bool {
        other.0 != 0 && self.0 & other.0 == other.0
    }
}

/// What one workload may read through the proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    pub paths: Vec<PathRule>,
    pub methods: Methods,
    /// Query parameter names it may send; any other is refused.
    pub query: Vec<String>,
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    Target(PathError),
    Method,
    Path,
    Parameter(String),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Target(e) => write!(f, "request target: {e}"),
            Refusal::Method => f.write_str("method not allowed"),
            Refusal::Path => f.write_str("path not allowed"),
            Refusal::Parameter(p) => write!(f, "query parameter {p:?} not allowed"),
        }
    }
}

impl Access {
    /// Whether `method target` may be served. Every check must pass: the target reads
    /// strictly, the method is listed, a rule covers the path, every parameter is listed.
    pub fn judge(&self, method: &str, target: &str) -> Result<(), Refusal> {
        let t = Target::parse(target).map_err(Refusal::Target)?;
        match Methods::parse(method) {
            Some(m) if self.methods.contains(m) => {}
            _ => return Err(Refusal::Method),
        }
        if !self.paths.iter().any(|r| r.matches(t.path)) {
            return Err(Refusal::Path);
        }
        if let Some((k, _)) = t.query.iter().find(|(k, _)| !self.query.iter().any(|q| q == k)) {
            return Err(Refusal::Parameter((*k).to_owned()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn rule(p: &str) -> PathRule {
        PathRule::parse(p).expect(p)
    }

    #[test]
    fn prefixes_cover_whole_segments_only() {
        let r = rule("/latest/meta-data/placement/");
        assert!(r.matches("/latest/meta-data/placement/region"));
        assert!(r.matches("/latest/meta-data/placement/"));
        assert!(r.matches("/latest/meta-data/placement"));
        assert!(!r.matches("/latest/meta-data/placementX"));
        assert!(!r.matches("/latest/meta-data/placementX/region"));
        assert!(!r.matches("/latest/meta-data/"));
        let exact = rule("/metadata");
        assert!(exact.matches("/metadata"));
        assert!(!exact.matches("/metadata-attacker"));
        assert!(!exact.matches("/metadata/"));
        assert!(!exact.matches("/metadata/instance"));
    }

    #[test]
    fn exact_rules_match_only_themselves() {
        let root = rule("=/");
        assert!(!root.is_prefix());
        assert_eq!((root.as_str(), root.path(), root.to_string().as_str()), ("=/", "/", "=/"));
        assert!(root.matches("/"));
        for p in ["/computeMetadata/v1/", "/computeMetadata", "/0.1/", "/latest"] {
            assert!(!root.matches(p), "=/ matches {p}");
        }
        let v1 = rule("=/computeMetadata/v1/");
        assert!(v1.matches("/computeMetadata/v1/"));
        assert!(!v1.matches("/computeMetadata/v1"));
        assert!(!v1.matches("/computeMetadata/v1/instance/service-accounts/default/token"));
        // `=` before a path without a trailing `/` says what the path says alone.
        assert_eq!(rule("=/latest/user-data"), rule("/latest/user-data"));
        assert_eq!(rule("=/latest/user-data").as_str(), "/latest/user-data");
        // The prefix `/` is still the whole service.
        assert!(rule("/").matches("/computeMetadata/v1/instance/service-accounts/default/token"));
    }

    #[test]
    fn exact_rules_are_checked_like_paths() {
        let rejected = [
            ("=", PathError::Exact),
            ("=latest/", PathError::Exact),
            ("==/", PathError::Exact),
            ("= /", PathError::Exact),
            ("=/a/../b/", PathError::DotSegment),
            ("=//", PathError::EmptySegment),
            ("=/a?b=c", PathError::Query),
            ("=/%2e/", PathError::PercentEncoded),
        ];
        for (r, e) in rejected {
            assert_eq!(PathRule::parse(r), Err(e), "{r:?}");
        }
        // `=` inside a path is an ordinary byte; only a leading one marks the rule.
        assert!(rule("/=/").is_prefix());
        assert_eq!(
            PathError::Exact.to_string(),
            "= (an exact path) must be followed by a path starting with /"
        );
    }

    #[test]
    fn overlaps_is_symmetric_and_whole_segment() {
        let cases = [
            ("/latest/meta-data/", "/latest/meta-data/iam/", true),
            ("/latest/meta-data/iam/info", "/latest/meta-data/iam/", true),
            ("/latest/meta-data/iam", "/latest/meta-data/iam/", true),
            ("/latest/meta-data/placement/", "/latest/meta-data/iam/", false),
            ("/latest/meta-data/iamX", "/latest/meta-data/iam/", false),
            ("/latest/user-data", "/latest/user-data", true),
            ("/latest/user-data", "/latest/user-data/x", false),
            ("/", "/latest/user-data", true),
            ("=/", "/", true),
            ("=/", "=/", true),
            ("=/", "/computeMetadata/v1/instance/service-accounts/", false),
            ("=/", "/0.1/", false),
            ("=/computeMetadata/v1/", "/computeMetadata/v1/", true),
            ("=/computeMetadata/v1/", "/computeMetadata/", true),
            ("=/computeMetadata/v1/", "/computeMetadata/v1/instance/service-accounts/", false),
            ("=/computeMetadata/v1/", "/computeMetadata/v1", false),
            ("=/computeMetadata/v1/", "=/computeMetadata/v1", false),
        ];
        for (a, b, want) in cases {
            assert_eq!(rule(a).overlaps(&rule(b)), want, "{a} ~ {b}");
            assert_eq!(rule(b).overlaps(&rule(a)), want, "{b} ~ {a}");
        }
    }

    #[test]
    fn method_names_round_trip() {
        let all = Methods::READ.union(Methods::PUT);
        assert_eq!(all.names().collect::<Vec<_>>(), ["GET", "HEAD", "PUT"]);
        assert_eq!(Methods::NONE.names().count(), 0);
        for (n, m) in Methods::NAMES {
            assert_eq!(Methods::parse(n), Some(m));
        }
        assert_eq!(Methods::parse("get"), None);
        assert_eq!(Methods::parse("POST"), None);
    }

    #[test]
    fn ambiguous_targets_are_refused() {
        let refused = [
            ("", PathError::NotOriginForm),
            ("*", PathError::NotOriginForm),
            ("http://169.254.169.254/latest/meta-data/", PathError::NotOriginForm),
            ("169.254.169.254:80", PathError::NotOriginForm),
            ("/latest/meta-data/placement/../iam/", PathError::DotSegment),
            ("/latest/meta-data/placement/..", PathError::DotSegment),
            ("/latest/./meta-data", PathError::DotSegment),
            ("/latest//meta-data", PathError::EmptySegment),
            ("//latest", PathError::EmptySegment),
            ("/latest/meta-data/placement%2f..%2fiam", PathError::PercentEncoded),
            ("/latest/meta-data/%2e%2e/iam", PathError::PercentEncoded),
            ("/latest\\meta-data", PathError::Backslash),
            ("/latest/meta-data#x", PathError::Fragment),
            ("/latest/meta data", PathError::Byte(b' ')),
            ("/latest/meta\tdata", PathError::Byte(b'\t')),
            ("/latest/\u{e9}", PathError::Byte(0xc3)),
            ("/computeMetadata/v1/?recursive=true&recursive=false", PathError::DuplicateParameter),
            ("/metadata/instance?api-version=2021%2D01", PathError::QueryParameter),
            ("/metadata/instance?=x", PathError::QueryParameter),
            ("/metadata/instance?a=b?c", PathError::QueryParameter),
        ];
        for (t, e) in refused {
            assert_eq!(Target::parse(t), Err(e), "{t:?}");
        }
        assert_eq!(Target::parse(&format!("/{}", "a".repeat(MAX_TARGET))), Err(PathError::TooLong));
        let t = Target::parse("/metadata/instance?api-version=2021-02-01&format=json").expect("ok");
        assert_eq!(t.path, "/metadata/instance");
        assert_eq!(t.query, [("api-version", "2021-02-01"), ("format", "json")]);
    }

    #[test]
    fn rules_refuse_what_targets_refuse_and_queries() {
        assert_eq!(PathRule::parse("latest/"), Err(PathError::NotOriginForm));
        assert_eq!(PathRule::parse("/a/../b"), Err(PathError::DotSegment));
        assert_eq!(PathRule::parse("/a?b=c"), Err(PathError::Query));
        assert!(rule("/").is_prefix());
    }

    fn access(paths: &[&str], methods: Methods, query: &[&str]) -> Access {
        Access {
            paths: paths.iter().map(|p| rule(p)).collect(),
            methods,
            query: query.iter().map(|q| q.to_string()).collect(),
        }
    }

    #[test]
    fn judge_needs_method_path_and_every_parameter() {
        let aws =
            access(&["/latest/meta-data/placement/", "/latest/api/token"], Methods::READ, &[]);
        assert_eq!(aws.judge("GET", "/latest/meta-data/placement/region"), Ok(()));
        assert_eq!(aws.judge("HEAD", "/latest/meta-data/placement/region"), Ok(()));
        assert_eq!(aws.judge("PUT", "/latest/api/token"), Err(Refusal::Method));
        assert_eq!(
            aws.judge("GET", "/latest/meta-data/iam/security-credentials/"),
            Err(Refusal::Path)
        );
        assert_eq!(aws.judge("POST", "/latest/meta-data/placement/region"), Err(Refusal::Method));
        assert_eq!(
            aws.judge("CONNECT", "169.254.169.254:80"),
            Err(Refusal::Target(PathError::NotOriginForm))
        );
        let v2 = access(&["/latest/api/token"], Methods::READ.union(Methods::PUT), &[]);
        assert_eq!(v2.judge("PUT", "/latest/api/token"), Ok(()));
        let gcp = access(&["/computeMetadata/v1/instance/zone"], Methods::READ, &["alt"]);
        assert_eq!(gcp.judge("GET", "/computeMetadata/v1/instance/zone?alt=text"), Ok(()));
        assert_eq!(
            gcp.judge("GET", "/computeMetadata/v1/instance/zone?recursive=true"),
            Err(Refusal::Parameter("recursive".into()))
        );
        assert_eq!(aws.judge("get", "/latest/meta-data/placement/region"), Err(Refusal::Method));
        let probe = access(&["=/", "=/computeMetadata/v1/"], Methods::READ, &[]);
        assert_eq!(probe.judge("GET", "/"), Ok(()));
        assert_eq!(probe.judge("GET", "/computeMetadata/v1/"), Ok(()));
        assert_eq!(
            probe.judge("GET", "/computeMetadata/v1/instance/service-accounts/default/token"),
            Err(Refusal::Path)
        );
        // The v1 root lists names only; `recursive=true` would send the whole tree.
        assert_eq!(
            probe.judge("GET", "/computeMetadata/v1/?recursive=true"),
            Err(Refusal::Parameter("recursive".into()))
        );
    }

    /// Paths built from segments an attacker would try.
    /// Valid rules and paths over a few names, half of them prefixes: they meet often.
    fn clean() -> impl Strategy<Value = String> {
        let names =
            prop::sample::select(vec!["latest", "meta-data", "iam", "placement", "placementX"]);
        (proptest::collection::vec(names, 0..4), any::<bool>(), any::<bool>()).prop_map(
            |(s, dir, exact)| {
                let path =
                    format!("/{}{}", s.join("/"), if dir && !s.is_empty() { "/" } else { "" });
                if exact { format!("={path}") } else { path }
            },
        )
    }

    /// [`segments`], a third of them marked exact (`=`).
    fn rules() -> impl Strategy<Value = String> {
        (segments(), 0..3u8).prop_map(|(p, k)| if k == 0 { format!("={p}") } else { p })
    }

    /// What `matches` was before exact rules: the reference a rule without `=` still follows.
    fn matches_before(rule: &str, path: &str) -> bool {
        match rule.strip_suffix('/') {
            None => path == rule,
            Some(dir) => path.starts_with(rule) || path == dir,
        }
    }

    fn segments() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                Just("latest".to_owned()),
                Just("meta-data".to_owned()),
                Just("placement".to_owned()),
                Just("placementX".to_owned()),
                Just("iam".to_owned()),
                Just(".".to_owned()),
                Just("..".to_owned()),
                Just("".to_owned()),
                Just("%2e%2e".to_owned()),
                Just("%2f".to_owned()),
                Just("a\\b".to_owned()),
                "[ -~]{0,6}",
            ],
            0..6,
        )
        .prop_map(|s| format!("/{}", s.join("/")))
    }

    proptest! {
        /// Whatever the bytes, parsing returns; an accepted target has none of the forms two
        /// parsers could read differently.
        #[test]
        fn accepted_targets_are_unambiguous(t in prop_oneof![segments(), ".{0,64}"]) {
            if let Ok(target) = Target::parse(&t) {
                let p = target.path;
                prop_assert!(p.starts_with('/'));
                prop_assert!(!p.contains("//") && !p.contains('%') && !p.contains('\\'));
                prop_assert!(p.bytes().all(|b| (0x21..0x7f).contains(&b)));
                prop_assert!(p.split('/').all(|s| s != "." && s != ".."));
            }
        }

        /// `check` never misses a reach: a path both rules match means they overlap.
        #[test]
        fn a_path_both_rules_match_means_they_overlap(
            a in clean(), b in clean(), p in clean(), nest in any::<bool>()
        ) {
            // Nested rules and a path below both half of the time: random ones rarely nest.
            let (b, p) = if nest {
                let b = format!("{}{}", a, b.trim_start_matches('=').trim_start_matches('/'));
                let p = format!("{}{}", b, p.trim_start_matches('=').trim_start_matches('/'));
                (b, p.trim_start_matches('=').to_owned())
            } else {
                (b, p.trim_start_matches('=').to_owned())
            };
            if let (Ok(a), Ok(b), Ok(t)) = (PathRule::parse(&a), PathRule::parse(&b), Target::parse(&p))
                && a.matches(t.path)
                && b.matches(t.path)
            {
                prop_assert!(a.overlaps(&b) && b.overlaps(&a), "{a} {b} {}", t.path);
            }
        }

        /// A rule matches a path only inside what it names: the same path, or for a prefix
        /// rule its directory and the whole segments below it.
        #[test]
        fn rules_never_match_outside_their_segments(r in rules(), p in segments()) {
            if let (Ok(rule), Ok(t)) = (PathRule::parse(&r), Target::parse(&p))
                && rule.matches(t.path)
            {
                let dir = rule.path().trim_end_matches('/');
                if rule.is_prefix() {
                    let below = format!("{}/", dir);
                    prop_assert!(t.path == dir || t.path.starts_with(&below));
                } else {
                    prop_assert_eq!(t.path, rule.path());
                }
            }
        }

        /// An exact rule (`=` and a path) matches its own path and nothing else: not the
        /// directory without its `/`, not a path below it.
        #[test]
        fn an_exact_rule_matches_only_itself(r in segments(), p in segments()) {
            if let Ok(rule) = PathRule::parse(&format!("={r}")) {
                prop_assert!(!rule.is_prefix());
                prop_assert_eq!(rule.path(), r.as_str());
                prop_assert!(rule.matches(&r));
                if let Ok(t) = Target::parse(&p) {
                    prop_assert_eq!(rule.matches(t.path), t.path == r, "={} ~ {}", r, t.path);
                }
                // Without a trailing `/`, `=` adds nothing: the same rule as the path alone.
                if !r.ends_with('/') {
                    prop_assert_eq!(Ok(rule), PathRule::parse(&r));
                }
            }
        }

        /// A rule written without `=` parses, prints, and matches as it did before exact
        /// rules: every policy keeps its meaning and its hash.
        #[test]
        fn rules_without_the_mark_are_unchanged(r in segments(), p in segments()) {
            if let Ok(rule) = PathRule::parse(&r) {
                prop_assert_eq!(rule.as_str(), r.as_str());
                prop_assert_eq!(rule.is_prefix(), r.ends_with('/'));
                if let Ok(t) = Target::parse(&p) {
                    prop_assert_eq!(rule.matches(t.path), matches_before(&r, t.path));
                }
            }
        }

        /// Judging is total and refuses every method but the listed ones.
        #[test]
        fn judge_never_serves_an_unlisted_method(m in "[A-Za-z]{0,8}", p in segments()) {
            let a = access(&["/"], Methods::READ, &[]);
            if a.judge(&m, &p).is_ok() {
                prop_assert!(m == "GET" || m == "HEAD");
            }
        }
    }
}
