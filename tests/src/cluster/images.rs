//! Images without a registry: each is written here as an OCI image layout archive (one
//! uncompressed layer, reproducible: sorted, owned by root, time 0) and imported into the
//! node's containerd, where the pods name it by digest. Hand-written because the format is
//! three small JSON documents around a tar, and a builder (buildah, docker) is what this
//! machine does not have.
//!
//! - the agent: this build's `gate-agent` at `/gate-agent` with the C libraries it links,
//!   run as root with `/gate-agent` as entrypoint, as the Dockerfile's distroless image has it;
//! - the pause image (the pods' sandbox), from Kubernetes' own `build/pause/linux/pause.c` in
//!   the pinned module, static, run as 65535 as upstream's;
//! - the client: Debian's busybox-static with its applets, and the harness's `probe` (HTTP,
//!   raw frames over AF_PACKET, a connect loop: Debian's static busybox crashes in `wget`,
//!   whose static glibc finds no name service to load in an image without one).
use std::{
    collections::BTreeMap,
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use serde_json::json;
use sha2::{Digest as _, Sha256};

use super::{root, show, target_dir};

/// What one path of a layer holds.
#[derive(Debug, Clone)]
enum Content {
    Dir,
    File { bytes: Vec<u8>, mode: u32 },
    Link(String),
}

/// An image to write: its name, its files, and how it runs.
#[derive(Debug, Clone)]
pub struct Image {
    /// The name containerd keeps it under (`localhost/…:tag`).
    pub name: String,
    files: BTreeMap<String, Content>,
    entrypoint: Vec<String>,
    user: String,
}

/// An image in containerd: its name and its manifest's digest (`sha256:…`).
#[derive(Debug, Clone)]
pub struct Imported {
    pub name: String,
    pub digest: String,
}

impl Imported {
    /// The reference by digest the manifests give (`name@sha256:…`, no tag).
    pub fn by_digest(&self) -> String {
        let repo = self.name.rsplit_once(':').map_or(self.name.as_str(), |(r, _)| r);
        format!("{repo}@{}", self.digest)
    }
}

impl Image {
    pub fn new(name: &str, entrypoint: &[&str], user: &str) -> Image {
        Image {
            name: name.to_owned(),
            files: BTreeMap::new(),
            entrypoint: entrypoint.iter().map(|s| (*s).to_owned()).collect(),
            user: user.to_owned(),
        }
    }

    /// Add `bytes` at `path` with `mode`, and its parent directories.
    pub fn file(&mut self, path: &str, bytes: Vec<u8>, mode: u32) -> &mut Image {
        self.parents(path);
        self.files.insert(path.trim_start_matches('/').to_owned(), Content::File { bytes, mode });
        self
    }

    /// Add a symbolic link at `path` to `target`.
    pub fn link(&mut self, path: &str, target: &str) -> &mut Image {
        self.parents(path);
        self.files
            .insert(path.trim_start_matches('/').to_owned(), Content::Link(target.to_owned()));
        self
    }

    pub fn dir(&mut self, path: &str) -> &mut Image {
        self.parents(path);
        self.files.insert(path.trim_start_matches('/').to_owned(), Content::Dir);
        self
    }

    fn parents(&mut self, path: &str) {
        let mut p = Path::new(path.trim_start_matches('/')).parent();
        while let Some(dir) = p.filter(|d| !d.as_os_str().is_empty()) {
            self.files.entry(dir.display().to_string()).or_insert(Content::Dir);
            p = dir.parent();
        }
    }

    /// Add the executable at `src` as `path`, with every shared library it loads (as `ldd`
    /// names them, at the same paths), as the distroless base gives glibc's.
    pub fn binary(&mut self, path: &str, src: &Path) -> Result<&mut Image> {
        let bytes = fs::read(src).with_context(|| format!("reading {}", src.display()))?;
        self.file(path, bytes, 0o755);
        let out = Command::new("ldd").arg(src).output().context("running ldd")?;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` or `/lib64/ld-linux… (0x…)`.
            let lib = line.split("=>").last().and_then(|r| r.split_whitespace().next());
            if let Some(lib) = lib.filter(|l| l.starts_with('/')) {
                let bytes = fs::read(lib).with_context(|| format!("reading {lib}"))?;
                self.file(lib, bytes, 0o755);
            }
        }
        Ok(self)
    }

    /// The layer: a tar of every path, sorted, owned by root, dated 0.
    fn layer(&self) -> Result<Vec<u8>> {
        let mut tar = tar::Builder::new(Vec::new());
        for (path, content) in &self.files {
            let mut h = tar::Header::new_ustar();
            h.set_mtime(0);
            h.set_uid(0);
            h.set_gid(0);
            match content {
                Content::Dir => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_mode(0o755);
                    h.set_size(0);
                    tar.append_data(&mut h, format!("{path}/"), std::io::empty())?;
                }
                Content::File { bytes, mode } => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_mode(*mode);
                    h.set_size(bytes.len() as u64);
                    tar.append_data(&mut h, path, bytes.as_slice())?;
                }
                Content::Link(target) => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_mode(0o777);
                    h.set_size(0);
                    tar.append_link(&mut h, path, target)?;
                }
            }
        }
        Ok(tar.into_inner()?)
    }

    /// Write the image as an OCI image layout archive at `out`; its manifest's digest.
    pub fn write(&self, out: &Path) -> Result<String> {
        let layer = self.layer()?;
        let layer_digest = digest(&layer);
        let config = serde_json::to_vec(&json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Entrypoint": self.entrypoint,
                "User": self.user,
                "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
            },
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }))?;
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": digest(&config),
                "size": config.len(),
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer.len(),
            }],
        }))?;
        let manifest_digest = digest(&manifest);
        // Two names, as a pull through the CRI leaves them: the tag, and the reference by
        // digest the pods give (the CRI resolves a reference only to a name it holds).
        let by_digest = Imported { name: self.name.clone(), digest: manifest_digest.clone() };
        let names = [self.name.clone(), by_digest.by_digest()];
        let index = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "manifests": names.iter().map(|name| json!({
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest.len(),
                "annotations": {"io.containerd.image.name": name},
            })).collect::<Vec<_>>(),
        }))?;
        let mut tar = tar::Builder::new(fs::File::create(out)?);
        let mut put = |path: String, bytes: &[u8]| -> Result<()> {
            let mut h = tar::Header::new_ustar();
            h.set_mode(0o644);
            h.set_mtime(0);
            h.set_size(bytes.len() as u64);
            tar.append_data(&mut h, path, bytes)?;
            Ok(())
        };
        put("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        put("index.json".into(), &index)?;
        for blob in [&layer, &config, &manifest] {
            put(format!("blobs/sha256/{}", hex(blob)), blob)?;
        }
        tar.into_inner()?.flush()?;
        Ok(manifest_digest)
    }
}

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(bytes))
}

/// Where the images' inputs and archives go.
fn images_dir() -> Result<PathBuf> {
    let dir = target_dir().join("cluster").join("images");
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("starting {}", show(cmd)))?;
    if !out.status.success() {
        bail!("{} failed: {}", show(cmd), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// The agent's image, from `agent` (this build's binary).
pub fn agent(agent: &Path) -> Result<Image> {
    let mut image = Image::new("localhost/metadata-gate:cluster", &["/gate-agent"], "0");
    image.binary("/gate-agent", agent)?;
    image.file("/etc/passwd", b"root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n".to_vec(), 0o644);
    image.file("/etc/group", b"root:x:0:\nnogroup:x:65534:\n".to_vec(), 0o644);
    image.dir("/tmp");
    Ok(image)
}

/// The pause image, compiled from the `pause.c` of the Kubernetes module tests/cluster pins.
pub fn pause() -> Result<Image> {
    let module = Command::new("go")
        .args(["-C"])
        .arg(root().join("tests/cluster"))
        .args(["list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes"])
        .output()
        .context("go list k8s.io/kubernetes")?;
    let module = PathBuf::from(String::from_utf8_lossy(&module.stdout).trim());
    let source = module.join("build/pause/linux/pause.c");
    let out = images_dir()?.join("pause");
    // Upstream's build flags (build/pause/Makefile), its version named for this build.
    run(Command::new("gcc")
        .args(["-Os", "-Wall", "-Werror", "-static", "-DVERSION=v3.10.1-metadata-gate", "-o"])
        .arg(&out)
        .arg(&source))
    .context("compiling pause.c (needs gcc and glibc's static libraries)")?;
    let mut image = Image::new(super::node::PAUSE_IMAGE, &["/pause"], "65535:65535");
    image.file("/pause", fs::read(&out)?, 0o755);
    Ok(image)
}

/// The client image: the machine's busybox (Debian's static build, which `cargo xtask setup`
/// installs) with its applets, and `probe`.
pub fn client(probe: &Path) -> Result<Image> {
    let busybox = Path::new("/bin/busybox");
    let mut image = Image::new("localhost/metadata-gate-client:cluster", &["/bin/sh"], "0");
    image.file("/bin/busybox", fs::read(busybox).context("reading /bin/busybox")?, 0o755);
    let list = Command::new(busybox).arg("--list").output().context("busybox --list")?;
    for applet in String::from_utf8_lossy(&list.stdout).lines().filter(|a| *a != "busybox") {
        image.link(&format!("/bin/{applet}"), "busybox");
    }
    image.binary("/usr/local/bin/probe", probe)?;
    image.dir("/tmp");
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The archive is an OCI layout whose blobs are named by their digests, and whose layer
    /// holds every file with its parents, in order.
    #[test]
    fn an_image_is_an_oci_layout_with_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut image = Image::new("localhost/x:1", &["/x"], "0");
        image.file("/usr/bin/x", b"hello".to_vec(), 0o755).link("/bin/y", "x");
        let out = dir.path().join("x.tar");
        let manifest = image.write(&out).unwrap();
        let mut archive = tar::Archive::new(fs::File::open(&out).unwrap());
        let mut blobs = BTreeMap::new();
        for e in archive.entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path().unwrap().display().to_string();
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut e, &mut bytes).unwrap();
            if let Some(h) = path.strip_prefix("blobs/sha256/") {
                assert_eq!(hex(&bytes), h, "{path}");
            }
            blobs.insert(path, bytes);
        }
        let index: serde_json::Value = serde_json::from_slice(&blobs["index.json"]).unwrap();
        assert_eq!(index["manifests"][0]["digest"], manifest.as_str());
        assert_eq!(
            index["manifests"][0]["annotations"]["io.containerd.image.name"],
            "localhost/x:1"
        );
        let by_digest = format!("localhost/x@{manifest}");
        assert_eq!(
            index["manifests"][1]["annotations"]["io.containerd.image.name"],
            by_digest.as_str()
        );
        let m: serde_json::Value =
            serde_json::from_slice(&blobs[&format!("blobs/sha256/{}", &manifest[7..])]).unwrap();
        let layer = m["layers"][0]["digest"].as_str().unwrap();
        let mut layer =
            tar::Archive::new(blobs[&format!("blobs/sha256/{}", &layer[7..])].as_slice());
        let names: Vec<String> = layer
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert_eq!(names, ["bin/", "bin/y", "usr/", "usr/bin/", "usr/bin/x"]);
        let again = image.write(&dir.path().join("again.tar")).unwrap();
        assert_eq!(again, manifest, "the same image gives the same digest");
        let imported = Imported { name: "localhost/x:1".into(), digest: manifest.clone() };
        assert_eq!(imported.by_digest(), format!("localhost/x@{manifest}"));
    }
}
