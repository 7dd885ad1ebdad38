//! The platform a node is on, by what the node itself says before any API server can be
//! asked (the boot step's `--platform auto`): the kernel command line's
//! `ignition.platform.id` on CoreOS, else the firmware's DMI strings. Each gives an OpenShift
//! PlatformType, the name the shipped policies go by; a node neither names is not guessed.
use std::path::Path;

use super::platform::{DmiField, DmiRule, Platform};

/// The platform a CoreOS node was provisioned on, from its kernel command line's
/// `ignition.platform.id` (RHCOS and Fedora CoreOS set it on every boot): the row whose
/// `ignition_ids` hold it. `qemu` (libvirt and bare VMs) has no metadata service: `None`.
pub fn from_ignition(cmdline: &str) -> Option<Platform> {
    let id = cmdline.split_whitespace().find_map(|w| w.strip_prefix("ignition.platform.id="))?;
    Platform::by_ignition_id(id)
}

/// The firmware strings the kernel exposes in `/sys/class/dmi/id`, and a Xen guest's
/// `/sys/hypervisor/uuid`: what a VM's provider says of it. Missing or unreadable ones are
/// empty (`product_uuid` and `product_serial` are readable by root only).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Dmi {
    pub sys_vendor: String,
    pub product_name: String,
    pub product_serial: String,
    pub product_uuid: String,
    pub chassis_asset_tag: String,
    pub hypervisor_uuid: String,
}

impl Dmi {
    /// Read them under `root` (`/` on a node).
    pub fn read(root: &Path) -> Dmi {
        let read = |rel: &str| {
            std::fs::read_to_string(root.join(rel)).map(|s| s.trim().to_owned()).unwrap_or_default()
        };
        let id = |f: &str| read(&format!("sys/class/dmi/id/{f}"));
        Dmi {
            sys_vendor: id("sys_vendor"),
            product_name: id("product_name"),
            product_serial: id("product_serial"),
            product_uuid: id("product_uuid"),
            chassis_asset_tag: id("chassis_asset_tag"),
            hypervisor_uuid: read("sys/hypervisor/uuid"),
        }
    }
}

impl Dmi {
    /// The string a rule reads.
    fn get(&self, field: DmiField) -> &str {
        match field {
            DmiField::SysVendor => &self.sys_vendor,
            DmiField::ProductName => &self.product_name,
            DmiField::ProductSerial => &self.product_serial,
            DmiField::ProductUuid => &self.product_uuid,
            DmiField::ChassisAssetTag => &self.chassis_asset_tag,
            DmiField::HypervisorUuid => &self.hypervisor_uuid,
        }
    }

    /// Whether `rule` holds.
    fn passes(&self, rule: &DmiRule) -> bool {
        let value = self.get(rule.field);
        rule.test.passes(value)
            && rule.same_as.is_none_or(|other| value.eq_ignore_ascii_case(self.get(other)))
    }
}

/// The platform a VM's DMI strings name, and which string said so: the rows' `dmi` rules,
/// which are cloud-init's (`tools/ds-identify`) and AWS's own (docs/platforms.md). Hypervisors
/// without a metadata service (VMware, KVM, Nutanix) are not named: their nodes set the
/// platform. Strings that two platforms' rules claim name neither: no platform is guessed.
pub fn from_dmi(d: &Dmi) -> Option<(Platform, &'static str)> {
    let mut named = Platform::all()
        .filter_map(|p| p.facts().dmi.iter().find(|r| d.passes(r)).map(|r| (p, r.field.name())));
    let first = named.next()?;
    named.next().is_none().then_some(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::shipped::policy_for;

    #[test]
    fn ignition_platform_ids() {
        let line =
            "BOOT_IMAGE=(hd0,gpt3)/ostree/rhcos/vmlinuz ignition.platform.id=aws root=UUID=x";
        assert_eq!(from_ignition(line), Some(Platform::Aws));
        assert_eq!(from_ignition("ignition.platform.id=oraclecloud"), Some(Platform::ExternalOci));
        assert_eq!(from_ignition("ignition.platform.id=hetzner"), Some(Platform::ExternalHetzner));
        assert_eq!(from_ignition("ignition.platform.id=unknowncloud"), None);
        assert_eq!(from_ignition("quiet splash"), None);
        // Every platform an id maps to has a shipped policy.
        for id in [
            "aws",
            "gcp",
            "azure",
            "openstack",
            "ibmcloud",
            "aliyun",
            "oraclecloud",
            "hetzner",
            "vmware",
            "kubevirt",
            "nutanix",
            "powervs",
            "packet",
            "metal",
            "qemu",
        ] {
            let p = from_ignition(&format!("ignition.platform.id={id}")).expect(id);
            policy_for(p.name()).unwrap_or_else(|e| panic!("{id}: {e}"));
        }
    }

    fn dmi(f: impl FnOnce(&mut Dmi)) -> Dmi {
        let mut d = Dmi::default();
        f(&mut d);
        d
    }

    #[test]
    fn dmi_platforms() {
        let cases = [
            (dmi(|d| d.sys_vendor = "Amazon EC2".into()), Some("AWS")),
            (
                dmi(|d| d.hypervisor_uuid = "ec2e1916-9099-7caf-fd21-012345abcdef".into()),
                Some("AWS"),
            ),
            (
                dmi(|d| {
                    d.product_uuid = "EC2E1916-9099-7CAF-FD21-012345ABCDEF".into();
                    d.product_serial = "ec2e1916-9099-7caf-fd21-012345abcdef".into();
                }),
                Some("AWS"),
            ),
            (dmi(|d| d.product_name = "Google Compute Engine".into()), Some("GCP")),
            (dmi(|d| d.product_serial = "GoogleCloud-4A3B2C1D".into()), Some("GCP")),
            (
                dmi(|d| d.chassis_asset_tag = "7783-7084-3265-9085-8269-3286-77".into()),
                Some("Azure"),
            ),
            (dmi(|d| d.product_name = "Alibaba Cloud ECS".into()), Some("AlibabaCloud")),
            (dmi(|d| d.chassis_asset_tag = "OracleCloud.com".into()), Some("External/oci")),
            (dmi(|d| d.sys_vendor = "Hetzner".into()), Some("External/hetzner")),
            (dmi(|d| d.product_name = "OpenStack Nova".into()), Some("OpenStack")),
            (dmi(|d| d.chassis_asset_tag = "HUAWEICLOUD".into()), Some("OpenStack")),
            // Not named: a bare KVM or VMware VM, a UUID that merely starts with ec2 (a
            // random one does, one time in 4 096), nothing at all.
            (dmi(|d| d.sys_vendor = "QEMU".into()), None),
            // Strings that two platforms' rules claim name neither.
            (
                dmi(|d| {
                    d.sys_vendor = "Amazon EC2".into();
                    d.product_name = "Google Compute Engine".into();
                }),
                None,
            ),
            (dmi(|d| d.sys_vendor = "VMware, Inc.".into()), None),
            (dmi(|d| d.product_uuid = "ec2c0ffe-0000-0000-0000-000000000000".into()), None),
            (Dmi::default(), None),
        ];
        for (d, want) in cases {
            let got = from_dmi(&d).map(|(p, _)| p.name());
            assert_eq!(got, want, "{d:?}");
            if let Some(p) = got {
                policy_for(p).unwrap_or_else(|e| panic!("{p}: {e}"));
            }
        }
    }

    #[test]
    fn dmi_is_read_from_sysfs_trimmed_and_missing_files_are_empty() {
        let root = tempfile::tempdir().expect("tempdir");
        let id = root.path().join("sys/class/dmi/id");
        std::fs::create_dir_all(&id).expect("mkdir");
        std::fs::write(id.join("sys_vendor"), "Amazon EC2\n").expect("write");
        std::fs::write(id.join("chassis_asset_tag"), "  i-0123456789abcdef0\n").expect("write");
        let d = Dmi::read(root.path());
        assert_eq!(d.sys_vendor, "Amazon EC2");
        assert_eq!(d.chassis_asset_tag, "i-0123456789abcdef0");
        assert_eq!((d.product_uuid.as_str(), d.hypervisor_uuid.as_str()), ("", ""));
        assert_eq!(from_dmi(&d), Some((Platform::Aws, "sys_vendor")));
    }
}
