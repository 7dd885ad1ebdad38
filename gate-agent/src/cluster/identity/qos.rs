//! A pod's quality-of-service class ([`QosClass`]), which decides the level of its cgroup:
//! computed from the resources, as the kubelet does, for a pod whose status has none yet; and
//! the parsing of Kubernetes resource quantities that takes.
use std::{collections::BTreeMap, fmt};

use k8s_openapi::api::core::v1::{PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// A pod's quality-of-service class, which decides the level of its cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QosClass {
    Guaranteed,
    Burstable,
    BestEffort,
}

impl QosClass {
    /// Every class, for iteration.
    pub const ALL: [QosClass; 3] =
        [QosClass::Guaranteed, QosClass::Burstable, QosClass::BestEffort];

    /// The spelling of `status.qosClass`.
    pub fn as_str(self) -> &'static str {
        match self {
            QosClass::Guaranteed => "Guaranteed",
            QosClass::Burstable => "Burstable",
            QosClass::BestEffort => "BestEffort",
        }
    }

    /// Parse a `status.qosClass` value.
    pub fn from_api(s: &str) -> Option<QosClass> {
        QosClass::ALL.into_iter().find(|q| q.as_str() == s)
    }

    /// The QoS-level cgroup name part (the class lower-cased), `None` for Guaranteed pods,
    /// which sit directly below the kubepods root.
    pub(super) fn level(self) -> Option<&'static str> {
        match self {
            QosClass::Guaranteed => None,
            QosClass::Burstable => Some("burstable"),
            QosClass::BestEffort => Some("besteffort"),
        }
    }
}

impl fmt::Display for QosClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The QoS class computed from the pod's resources, for a pod whose status has none yet.
///
/// Follows `ComputePodQOS` in kubernetes `pkg/apis/core/helper/qos/qos.go`: pod-level
/// `spec.resources`, when set, decide alone; otherwise each init and regular container is
/// classified (ephemeral containers cannot have resources) and the pod is Burstable unless
/// all containers have the same class. A container (or the pod level) is BestEffort with
/// neither requests nor limits for cpu and memory, Guaranteed when both cpu and memory have
/// equal non-zero requests and limits, and Burstable otherwise.
///
/// The error is (field, reason) for a quantity that cannot be parsed.
pub(super) fn compute_qos(spec: &PodSpec) -> Result<QosClass, (String, String)> {
    if let Some(r) = &spec.resources {
        return requirements_qos(r, "spec.resources");
    }
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, c)| (format!("spec.initContainers[{i}].resources"), c))
        .chain(
            spec.containers
                .iter()
                .enumerate()
                .map(|(i, c)| (format!("spec.containers[{i}].resources"), c)),
        );
    let mut pod_qos = None;
    for (field, c) in containers {
        let qos = match &c.resources {
            Some(r) => requirements_qos(r, &field)?,
            None => QosClass::BestEffort,
        };
        match pod_qos {
            _ if qos == QosClass::Burstable => return Ok(QosClass::Burstable),
            None => pod_qos = Some(qos),
            Some(p) if p != qos => return Ok(QosClass::Burstable),
            Some(_) => {}
        }
    }
    Ok(pod_qos.unwrap_or(QosClass::BestEffort))
}

/// The class of one set of requirements (`resourceQOS` in the same file).
fn requirements_qos(r: &ResourceRequirements, field: &str) -> Result<QosClass, (String, String)> {
    let (requests, limits) = (r.requests.as_ref(), r.limits.as_ref());
    if requests.is_none_or(|m| m.is_empty()) && limits.is_none_or(|m| m.is_empty()) {
        return Ok(QosClass::BestEffort);
    }
    let mut class = None;
    for resource in ["cpu", "memory"] {
        let req = quantity_of(requests, resource, &format!("{field}.requests.{resource}"))?;
        let lim = quantity_of(limits, resource, &format!("{field}.limits.{resource}"))?;
        if req != lim {
            return Ok(QosClass::Burstable);
        }
        let this = if req == 0 { QosClass::BestEffort } else { QosClass::Guaranteed };
        match class {
            None => class = Some(this),
            Some(c) if c != this => return Ok(QosClass::Burstable),
            Some(_) => {}
        }
    }
    Ok(class.unwrap_or(QosClass::BestEffort))
}

/// A resource's quantity in a list, in nano-units (0 when absent).
fn quantity_of(
    list: Option<&BTreeMap<String, Quantity>>,
    resource: &str,
    field: &str,
) -> Result<i128, (String, String)> {
    match list.and_then(|m| m.get(resource)) {
        None => Ok(0),
        Some(Quantity(q)) => parse_quantity(q)
            .ok_or_else(|| (field.to_owned(), format!("cannot parse quantity {q:?}"))),
    }
}

/// Parse a Kubernetes resource quantity (`<sign><digits>[.<digits>]<suffix>`, suffix one of
/// `n u m "" k M G T P E`, `Ki Mi Gi Ti Pi Ei` or `e<exponent>`/`E<exponent>`) into nano-units,
/// rounding up below one nano as the apimachinery `resource.Quantity` does. `None` for text
/// that is not a quantity or a value too large to represent.
fn parse_quantity(s: &str) -> Option<i128> {
    let (negative, rest) = match s.as_bytes().first()? {
        b'+' => (false, &s[1..]),
        b'-' => (true, &s[1..]),
        _ => (false, s),
    };
    let num_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(num_end);
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if (int_part.is_empty() && frac_part.is_empty()) || frac_part.contains('.') {
        return None;
    }
    let digits = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    let mantissa: i128 = if digits.is_empty() { 0 } else { digits.parse().ok()? };
    let mut exp10 = -i32::try_from(frac_part.len()).ok()?;
    let mut pow1024 = 0u32;
    match suffix {
        "" => {}
        "n" => exp10 -= 9,
        "u" => exp10 -= 6,
        "m" => exp10 -= 3,
        "k" => exp10 += 3,
        "M" => exp10 += 6,
        "G" => exp10 += 9,
        "T" => exp10 += 12,
        "P" => exp10 += 15,
        "E" => exp10 += 18,
        "Ki" => pow1024 = 1,
        "Mi" => pow1024 = 2,
        "Gi" => pow1024 = 3,
        "Ti" => pow1024 = 4,
        "Pi" => pow1024 = 5,
        "Ei" => pow1024 = 6,
        _ => {
            let exp = suffix.strip_prefix(['e', 'E'])?;
            let unsigned = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            exp10 = exp10.checked_add(exp.parse::<i32>().ok()?)?;
        }
    }
    let mut value = mantissa.checked_mul(1024i128.checked_pow(pow1024)?)?;
    let scale = exp10.checked_add(9)?;
    if scale >= 0 {
        value = value.checked_mul(10i128.checked_pow(scale.unsigned_abs())?)?;
    } else if value != 0 {
        // Below one nano: round up, as apimachinery does.
        value = match 10i128.checked_pow(scale.unsigned_abs()) {
            Some(d) => value / d + i128::from(value % d != 0),
            None => 1,
        };
    }
    Some(if negative { -value } else { value })
}

#[cfg(test)]
mod tests;
