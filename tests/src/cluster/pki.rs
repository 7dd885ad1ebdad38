//! The test cluster's certificates and keys, made fresh for each cluster (nothing is kept or
//! shared): a CA; the API server's serving certificate for every name a client in the node's
//! network namespace uses; client certificates for the admin (`system:masters`) and for the
//! API server's calls to kubelets; the service-account signing key. ECDSA P-256 throughout
//! (rcgen's default), which every component reads.
use std::{fs, net::IpAddr, path::Path};

use anyhow::{Context as _, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};

/// The files [`write`] leaves in its directory.
pub(super) const CA: &str = "ca.crt";
pub(super) const SERVER_CERT: &str = "apiserver.crt";
pub(super) const SERVER_KEY: &str = "apiserver.key";
pub(super) const ADMIN_CERT: &str = "admin.crt";
pub(super) const ADMIN_KEY: &str = "admin.key";
pub(super) const CONTROLLER_CERT: &str = "controller-manager.crt";
pub(super) const CONTROLLER_KEY: &str = "controller-manager.key";
pub(super) const SCHEDULER_CERT: &str = "scheduler.crt";
pub(super) const SCHEDULER_KEY: &str = "scheduler.key";
/// The CA's key: the controller manager signs the kubelets' certificates with it.
pub(super) const CA_KEY: &str = "ca.key";
pub(super) const KUBELET_CLIENT_CERT: &str = "apiserver-kubelet-client.crt";
pub(super) const KUBELET_CLIENT_KEY: &str = "apiserver-kubelet-client.key";
/// The kubelet's client certificate (`system:node:<name>` in `system:nodes`, as the Node
/// authorizer and NodeRestriction need it) and its serving certificate.
pub(super) const NODE_CERT: &str = "kubelet.crt";
pub(super) const NODE_KEY: &str = "kubelet.key";
pub(super) const NODE_SERVING_CERT: &str = "kubelet-serving.crt";
pub(super) const NODE_SERVING_KEY: &str = "kubelet-serving.key";
/// The service-account signing key (PKCS#8), and its public half, which the API server
/// reads apart (it takes no public key out of a PKCS#8 private key).
pub(super) const SA_KEY: &str = "sa.key";
pub(super) const SA_PUB: &str = "sa.pub";

/// The API server's names: loopback and the node's address in its network namespace, and the
/// in-cluster Service's (`kubernetes` at the first address of the service range).
pub(super) fn server_names(node: IpAddr, service: IpAddr) -> Vec<SanType> {
    let mut names: Vec<SanType> = ["localhost", "kubernetes", "kubernetes.default"]
        .into_iter()
        .chain(["kubernetes.default.svc", "kubernetes.default.svc.cluster.local"])
        .filter_map(|n| n.try_into().ok().map(SanType::DnsName))
        .collect();
    names.extend([IpAddr::from([127, 0, 0, 1]), node, service].map(SanType::IpAddress));
    names
}

/// The node a kubelet certificate is made for: its name and address.
pub(super) struct Kubelet {
    pub(super) name: String,
    pub(super) ip: IpAddr,
}

/// The kubelet's serving names: the API server reaches it at its address (`exec`, `logs`).
fn kubelet_names(kubelet: &Kubelet) -> Vec<SanType> {
    let mut names: Vec<SanType> =
        kubelet.name.clone().try_into().ok().map(SanType::DnsName).into_iter().collect();
    names.push(SanType::IpAddress(kubelet.ip));
    names
}

/// A subject of `cn`, in the organisations (groups, to Kubernetes) `orgs`.
fn subject(cn: &str, orgs: &[&str]) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    for o in orgs {
        dn.push(DnType::OrganizationName, *o);
    }
    dn.push(DnType::CommonName, cn);
    dn
}

/// A leaf certificate of `cn` in `orgs` for `usage`, signed by `ca`: (certificate, key) PEM.
fn leaf(
    ca: &CertifiedIssuer<'_, KeyPair>,
    cn: &str,
    orgs: &[&str],
    usage: ExtendedKeyUsagePurpose,
    names: Vec<SanType>,
) -> Result<(String, String)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = subject(cn, orgs);
    params.subject_alt_names = names;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = vec![usage];
    let cert = params.signed_by(&key, ca)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Make every file into `dir` for a cluster whose API server answers on `node` (and
/// loopback) and whose Service range starts at `service`.
pub(super) fn write(dir: &Path, node: IpAddr, service: IpAddr, kubelet: &Kubelet) -> Result<()> {
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = subject("metadata-gate test cluster CA", &[]);
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let ca_key = KeyPair::generate()?;
    let ca_key_pem = ca_key.serialize_pem();
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key)?;
    let files = [
        (SERVER_CERT, SERVER_KEY, "kube-apiserver", &[][..], ExtendedKeyUsagePurpose::ServerAuth),
        (ADMIN_CERT, ADMIN_KEY, "metadata-gate-admin", &["system:masters"][..], CLIENT),
        // The name the bootstrap RBAC roles give the controller manager's permissions to.
        (CONTROLLER_CERT, CONTROLLER_KEY, "system:kube-controller-manager", &[][..], CLIENT),
        (SCHEDULER_CERT, SCHEDULER_KEY, "system:kube-scheduler", &[][..], CLIENT),
        (
            KUBELET_CLIENT_CERT,
            KUBELET_CLIENT_KEY,
            // Bound to system:kubelet-api-admin by the control plane, and nothing else.
            "kube-apiserver-kubelet-client",
            &[][..],
            CLIENT,
        ),
    ];
    let node_cn = format!("system:node:{}", kubelet.name);
    let files = files.into_iter().chain([
        (NODE_CERT, NODE_KEY, node_cn.as_str(), &["system:nodes"][..], CLIENT),
        (NODE_SERVING_CERT, NODE_SERVING_KEY, node_cn.as_str(), &[][..], SERVER),
    ]);
    const SERVER: ExtendedKeyUsagePurpose = ExtendedKeyUsagePurpose::ServerAuth;
    const CLIENT: ExtendedKeyUsagePurpose = ExtendedKeyUsagePurpose::ClientAuth;
    let put = |name: &str, text: &str| {
        fs::write(dir.join(name), text).with_context(|| format!("writing {}", dir.display()))
    };
    put(CA, &ca.pem())?;
    put(CA_KEY, &ca_key_pem)?;
    for (cert, key, cn, orgs, usage) in files {
        let names = match cert {
            SERVER_CERT => server_names(node, service),
            NODE_SERVING_CERT => kubelet_names(kubelet),
            _ => Vec::new(),
        };
        let (c, k) = leaf(&ca, cn, orgs, usage, names)?;
        put(cert, &c)?;
        put(key, &k)?;
    }
    let sa = KeyPair::generate()?;
    put(SA_KEY, &sa.serialize_pem())?;
    put(SA_PUB, &sa.public_key_pem())
}

/// A kubeconfig for `user`'s certificate and key (files in `dir`) at `server`.
pub(super) fn kubeconfig(dir: &Path, server: &str, cert: &str, key: &str) -> Result<String> {
    use base64::Engine as _;
    let b64 = |name: &str| -> Result<String> {
        let bytes = fs::read(dir.join(name)).with_context(|| format!("reading {name}"))?;
        Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
    };
    Ok(format!(
        "apiVersion: v1
kind: Config
clusters:
  - name: test
    cluster: {{server: \"{server}\", certificate-authority-data: {ca}}}
users:
  - name: user
    user: {{client-certificate-data: {cert}, client-key-data: {key}}}
contexts:
  - name: test
    context: {{cluster: test, user: user}}
current-context: test
",
        ca = b64(CA)?,
        cert = b64(cert)?,
        key = b64(key)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file is there, and `openssl` reads the server certificate as the API server's
    /// clients need it: signed by the CA, with the names they connect to.
    #[test]
    fn certificates_chain_to_the_ca_and_name_the_server() {
        let dir = tempfile::tempdir().unwrap();
        let node: IpAddr = "169.254.0.1".parse().unwrap();
        let kubelet = Kubelet { name: "node-1".into(), ip: "10.250.0.1".parse().unwrap() };
        write(dir.path(), node, "10.96.0.1".parse().unwrap(), &kubelet).unwrap();
        for f in [CA, SERVER_CERT, SERVER_KEY, ADMIN_CERT, ADMIN_KEY, SA_KEY, SA_PUB] {
            assert!(fs::metadata(dir.path().join(f)).unwrap().len() > 100, "{f}");
        }
        let Ok(out) = std::process::Command::new("openssl")
            .args(["verify", "-CAfile", CA, SERVER_CERT, ADMIN_CERT, NODE_CERT, NODE_SERVING_CERT])
            .current_dir(dir.path())
            .output()
        else {
            return;
        };
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = std::process::Command::new("openssl")
            .args(["x509", "-noout", "-text", "-in", SERVER_CERT])
            .current_dir(dir.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&text.stdout);
        for name in ["IP Address:169.254.0.1", "IP Address:127.0.0.1", "DNS:kubernetes.default"] {
            assert!(text.contains(name), "{name} missing:\n{text}");
        }
        let admin = std::process::Command::new("openssl")
            .args(["x509", "-noout", "-subject", "-in", ADMIN_CERT])
            .current_dir(dir.path())
            .output()
            .unwrap();
        let subject = String::from_utf8_lossy(&admin.stdout);
        assert!(subject.contains("O = system:masters"), "{subject}");
        let kc = kubeconfig(dir.path(), "https://127.0.0.1:6443", ADMIN_CERT, ADMIN_KEY).unwrap();
        assert!(kc.contains("server: \"https://127.0.0.1:6443\""), "{kc}");
    }
}
