//! The rows: one per [`Platform`], each with its sources in docs/platforms.md. A new provider
//! is a variant of [`Platform`] and one row here (docs/new-provider.md).
use super::super::protocol::Protocol;
use super::{
    AnswerGate, DmiField, DmiRule, DmiTest, Facts, Platform, Profile, ProxyFacts, SafePath,
    Sensitive, Service, SessionScheme,
};

/// The row of `p`: a `match`, so that a variant without a row does not compile.
pub(super) fn facts(p: Platform) -> &'static Facts {
    match p {
        Platform::Aws => &AWS,
        Platform::Azure => &AZURE,
        Platform::BareMetal => &BAREMETAL,
        Platform::Gcp => &GCP,
        Platform::Libvirt => &LIBVIRT,
        Platform::OpenStack => &OPENSTACK,
        Platform::None => &NONE,
        Platform::VSphere => &VSPHERE,
        Platform::OVirt => &OVIRT,
        Platform::IbmCloud => &IBMCLOUD,
        Platform::KubeVirt => &KUBEVIRT,
        Platform::EquinixMetal => &EQUINIXMETAL,
        Platform::PowerVs => &POWERVS,
        Platform::AlibabaCloud => &ALIBABACLOUD,
        Platform::Nutanix => &NUTANIX,
        Platform::ExternalOci => &EXTERNAL_OCI,
        Platform::ExternalHetzner => &EXTERNAL_HETZNER,
    }
}

const TCP: &[Protocol] = &[Protocol::Tcp];
const UDP: &[Protocol] = &[Protocol::Udp];

const fn svc(
    what: &'static str,
    net: &'static str,
    ports: &'static [u16],
    protocols: &'static [Protocol],
) -> Service {
    Service { what, net, ports, protocols }
}

const fn get(path: &'static str, reveals: &'static str) -> SafePath {
    SafePath { path, method: "GET", reveals, fixed: None }
}

/// A path whose value `source` documents as fixed: answered from the proxy's cache.
const fn fixed(path: &'static str, reveals: &'static str, source: &'static str) -> SafePath {
    SafePath { path, method: "GET", reveals, fixed: Some(source) }
}

const fn put(path: &'static str, reveals: &'static str) -> SafePath {
    SafePath { path, method: "PUT", reveals, fixed: None }
}

const fn never(path: &'static str, reveals: &'static str) -> Sensitive {
    Sensitive { path, reveals }
}

/// The `safe` profile of a row.
const fn safe(paths: &'static [SafePath], query: &'static [&'static str]) -> Profile {
    Profile { name: SAFE, paths, query }
}

/// AWS's list of instance metadata categories: the instance id, type, region and zone id stay
/// as they are while the instance runs (a type change needs a stop, which is a new boot).
const AWS_CATEGORIES: &str =
    "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-categories.html";
/// Azure IMDS's compute category: location, vmId and vmSize of the running VM.
const AZURE_IMDS: &str =
    "https://learn.microsoft.com/en-us/azure/virtual-machines/instance-metadata-service";
/// Compute Engine's predefined metadata keys: id, name, zone, machine type, project id and
/// number.
const GCE_KEYS: &str = "https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys";

/// The profile name of paths that say where a workload runs and nothing that authenticates it.
const SAFE: &str = "safe";

const fn dmi(field: DmiField, test: DmiTest) -> DmiRule {
    DmiRule { field, test, same_as: None }
}

/// A row of a platform without a metadata service at a fixed address.
const fn without_metadata(
    name: &'static str,
    ignition_ids: &'static [&'static str],
    provider_ids: &'static [&'static str],
    why: &'static str,
    shipped: &'static str,
) -> Facts {
    Facts {
        name,
        ignition_ids,
        dmi: &[],
        provider_ids,
        metadata: &[],
        keep_open: &[],
        no_metadata_service: Some(why),
        profiles: &[],
        sensitive: &[],
        proxy: ProxyFacts::NONE,
        shipped: Some(shipped),
    }
}

const CONFIG_DRIVE: &str = "nodes take their configuration from a config drive, guest properties or the kernel command \
     line, not from a link-local metadata service";

const SESSION_TOKEN: &str =
    "a session token for the metadata service itself (the instance rejects it elsewhere)";

/// The EC2-style tree, shared by AWS and Alibaba Cloud where their paths agree.
const USER_DATA: Sensitive = never("/latest/user-data", "user data (often bootstrap secrets)");
const PUBLIC_KEYS: Sensitive = never("/latest/meta-data/public-keys/", "SSH public keys");

/// OpenStack's DMI names, as product_name or chassis_asset_tag.
const OPENSTACK_NAMES: [&str; 2] = ["OpenStack Nova", "OpenStack Compute"];

const AWS: Facts = Facts {
    name: "AWS",
    ignition_ids: &["aws"],
    // AWS's "Detect whether a host is an EC2 instance": Nitro and bare-metal instances say
    // so in sys_vendor; Xen ones by a UUID that starts with ec2 (the product UUID only
    // where the serial repeats it, as a random UUID starts with ec2 one time in 4 096).
    dmi: &[
        dmi(DmiField::SysVendor, DmiTest::Is("Amazon EC2")),
        dmi(DmiField::HypervisorUuid, DmiTest::StartsWithAnyCase("ec2")),
        DmiRule {
            field: DmiField::ProductUuid,
            test: DmiTest::StartsWithAnyCase("ec2"),
            same_as: Some(DmiField::ProductSerial),
        },
    ],
    provider_ids: &["aws"],
    metadata: &[
        svc("EC2 instance metadata service", "169.254.169.254/32", &[80], TCP),
        svc("EC2 instance metadata service (IPv6)", "fd00:ec2::254/128", &[80], TCP),
    ],
    keep_open: &[
        svc("the Amazon DNS server", "169.254.169.253/32", &[53], &[]),
        svc("the Amazon DNS server (IPv6)", "fd00:ec2::253/128", &[53], &[]),
        svc("Amazon Time Sync (NTP)", "169.254.169.123/32", &[123], UDP),
        svc("Amazon Time Sync (NTP, IPv6)", "fd00:ec2::123/128", &[123], UDP),
        svc(
            "the EKS Pod Identity agent, which serves pods their own credentials",
            "169.254.170.23/32",
            &[80],
            TCP,
        ),
        svc(
            "the EKS Pod Identity agent (IPv6), which serves pods their own credentials",
            "fd00:ec2::23/128",
            &[80],
            TCP,
        ),
    ],
    no_metadata_service: None,
    profiles: &[safe(
        &[
            put("/latest/api/token", SESSION_TOKEN),
            fixed("/latest/meta-data/instance-id", "the instance id", AWS_CATEGORIES),
            fixed("/latest/meta-data/instance-type", "the instance type", AWS_CATEGORIES),
            fixed("/latest/meta-data/placement/region", "the region", AWS_CATEGORIES),
            // With its trailing `/` (a prefix: the path with or without it): botocore asks
            // for `…/availability-zone/`. A prefix is never cached.
            get("/latest/meta-data/placement/availability-zone/", "the availability zone"),
            fixed(
                "/latest/meta-data/placement/availability-zone-id",
                "the availability zone id",
                AWS_CATEGORIES,
            ),
        ],
        &[],
    )],
    sensitive: &[
        never("/latest/meta-data/iam/", "the instance profile and its temporary credentials"),
        never("/latest/meta-data/identity-credentials/", "the instance identity credentials"),
        never(
            "/latest/dynamic/instance-identity/",
            "the signed instance identity document (signature, pkcs7, rsa2048)",
        ),
        USER_DATA,
        PUBLIC_KEYS,
        never("/latest/meta-data/tags/", "instance tags, which users fill"),
    ],
    proxy: ProxyFacts {
        session: Some(SessionScheme {
            path: "/latest/api/token",
            token_header: "x-aws-ec2-metadata-token",
            ttl_header: "x-aws-ec2-metadata-token-ttl-seconds",
            max_ttl: 21600,
        }),
        answers_need: AnswerGate::Session,
    },
    shipped: Some(include_str!("../../../../deploy/policies/aws.yaml")),
};

const AZURE: Facts = Facts {
    name: "Azure",
    ignition_ids: &["azure", "azurestack"],
    // Azure's fixed chassis asset tag, the same on every Azure VM.
    dmi: &[dmi(DmiField::ChassisAssetTag, DmiTest::Is("7783-7084-3265-9085-8269-3286-77"))],
    provider_ids: &["azure"],
    metadata: &[
        svc("Azure Instance Metadata Service", "169.254.169.254/32", &[80], TCP),
        svc("the WireServer and host agent plugin", "168.63.129.16/32", &[80, 32526], TCP),
    ],
    keep_open: &[svc("Azure DNS", "168.63.129.16/32", &[53], &[])],
    no_metadata_service: None,
    profiles: &[safe(
        &[
            fixed("/metadata/instance/compute/location", "the region", AZURE_IMDS),
            get("/metadata/instance/compute/zone", "the availability zone (may be empty)"),
            fixed("/metadata/instance/compute/vmId", "the VM's unique id", AZURE_IMDS),
            // A resize restarts the VM (a new boot).
            fixed("/metadata/instance/compute/vmSize", "the VM size", AZURE_IMDS),
        ],
        &["api-version", "format"],
    )],
    sensitive: &[
        never("/metadata/identity/", "managed identity OAuth tokens"),
        never("/metadata/attested/", "the signed attested document"),
        never(
            "/metadata/instance/compute/userData",
            "user data (the whole /metadata/instance document holds it too)",
        ),
        never("/metadata/instance/compute/customData", "custom data"),
        never("/metadata/instance/compute/osProfile", "the admin user name"),
        never("/metadata/instance/compute/publicKeys", "SSH public keys"),
        never(
            "/metadata/instance/compute/storageProfile",
            "disk encryption settings (Key Vault URLs)",
        ),
        never("/machine", "the WireServer's goal state: certificates, extension secrets"),
    ],
    proxy: ProxyFacts {
        session: None,
        answers_need: AnswerGate::Header { name: "metadata", value: "true" },
    },
    shipped: Some(include_str!("../../../../deploy/policies/azure.yaml")),
};

const BAREMETAL: Facts = without_metadata(
    "BareMetal",
    &["metal"],
    &["baremetalhost", "metal3"],
    CONFIG_DRIVE,
    include_str!("../../../../deploy/policies/baremetal.yaml"),
);

const GCP: Facts = Facts {
    name: "GCP",
    ignition_ids: &["gcp"],
    dmi: &[
        dmi(DmiField::ProductName, DmiTest::Is("Google Compute Engine")),
        dmi(DmiField::ProductSerial, DmiTest::StartsWith("GoogleCloud-")),
    ],
    provider_ids: &["gce"],
    metadata: &[
        svc("the Compute Engine metadata server", "169.254.169.254/32", &[80, 443, 8080], TCP),
        svc("the Compute Engine metadata server (IPv6)", "fd20:ce::254/128", &[80, 443, 8080], TCP),
    ],
    keep_open: &[
        svc("the VM's DNS resolver", "169.254.169.254/32", &[53], &[]),
        svc("the metadata server's NTP service", "169.254.169.254/32", &[123], UDP),
    ],
    no_metadata_service: None,
    profiles: &[safe(
        &[
            // GCE's detection probe, the root alone (`=`: exact, not the tree below it).
            // google-auth's `_metadata.ping` (under `is_on_gce` and `google.auth.default()`)
            // sends `GET http://169.254.169.254` with `Metadata-Flavor: Google` and believes
            // it runs on GCE only on a 200 that carries `Metadata-Flavor: Google` back;
            // cloud.google.com/go/compute/metadata's `OnGCE` asks the same. Google documents
            // the header as the sign of its metadata server: "Detect if running in Compute
            // Engine", https://cloud.google.com/compute/docs/instances/detect-compute-engine.
            get("=/", "that a metadata server answers, and the names of its trees"),
            // The v1 root: the names of its directories (`instance/`, `project/`, …), never
            // their contents (`recursive` is not among the profile's query parameters).
            get("=/computeMetadata/v1/", "the names of the v1 tree's directories"),
            fixed("/computeMetadata/v1/instance/id", "the instance id", GCE_KEYS),
            fixed("/computeMetadata/v1/instance/name", "the instance name", GCE_KEYS),
            fixed(
                "/computeMetadata/v1/instance/zone",
                "the zone (and with it the region)",
                GCE_KEYS,
            ),
            // Changed only while the VM is stopped (a new boot).
            fixed("/computeMetadata/v1/instance/machine-type", "the machine type", GCE_KEYS),
            fixed("/computeMetadata/v1/project/project-id", "the project id", GCE_KEYS),
            fixed("/computeMetadata/v1/project/numeric-project-id", "the project number", GCE_KEYS),
        ],
        &[],
    )],
    sensitive: &[
        never(
            "/computeMetadata/v1/instance/service-accounts/",
            "OAuth access tokens and signed identity tokens of the node's service accounts",
        ),
        never(
            "/computeMetadata/v1/instance/attributes/",
            "instance metadata: ssh-keys, startup scripts, user data, and GKE's kube-env \
             (the kubelet's bootstrap credentials)",
        ),
        never("/computeMetadata/v1/project/attributes/", "project-wide SSH keys and metadata"),
        never(
            "/computeMetadata/v1/instance/guest-attributes/",
            "values workloads can write for others to read",
        ),
        never("/computeMetadata/v1beta1/", "the legacy tree, with the same data"),
        never("/0.1/", "the legacy tree, with the same data"),
    ],
    proxy: ProxyFacts {
        session: None,
        answers_need: AnswerGate::Header { name: "metadata-flavor", value: "Google" },
    },
    shipped: Some(include_str!("../../../../deploy/policies/gcp.yaml")),
};

const LIBVIRT: Facts = without_metadata(
    "Libvirt",
    // A libvirt node boots with ignition.platform.id=qemu, which names `None`.
    &[],
    &["libvirt"],
    CONFIG_DRIVE,
    include_str!("../../../../deploy/policies/libvirt.yaml"),
);

const OPENSTACK: Facts = Facts {
    name: "OpenStack",
    ignition_ids: &["openstack"],
    dmi: &[
        dmi(DmiField::ProductName, DmiTest::Is(OPENSTACK_NAMES[0])),
        dmi(DmiField::ProductName, DmiTest::Is(OPENSTACK_NAMES[1])),
        dmi(DmiField::ChassisAssetTag, DmiTest::Is(OPENSTACK_NAMES[0])),
        dmi(DmiField::ChassisAssetTag, DmiTest::Is(OPENSTACK_NAMES[1])),
        dmi(DmiField::ChassisAssetTag, DmiTest::Is("OpenTelekomCloud")),
        dmi(DmiField::ChassisAssetTag, DmiTest::Is("SAP CCloud VM")),
        dmi(DmiField::ChassisAssetTag, DmiTest::Is("HUAWEICLOUD")),
    ],
    provider_ids: &["openstack"],
    metadata: &[
        svc("the Nova metadata service", "169.254.169.254/32", &[80], TCP),
        svc("the Nova metadata service (IPv6)", "fe80::a9fe:a9fe/128", &[80], TCP),
    ],
    keep_open: &[],
    no_metadata_service: None,
    profiles: &[safe(
        &[
            get("/latest/meta-data/instance-id", "the EC2-style instance id (not the Nova UUID)"),
            get("/latest/meta-data/instance-type", "the flavor"),
            get("/latest/meta-data/placement/availability-zone", "the availability zone"),
        ],
        &[],
    )],
    sensitive: &[
        never(
            "/openstack/",
            "meta_data.json (SSH keys, user properties), user_data, vendor data (deployer \
             tokens), the encrypted admin password",
        ),
        USER_DATA,
        PUBLIC_KEYS,
    ],
    proxy: ProxyFacts::NONE,
    shipped: Some(include_str!("../../../../deploy/policies/openstack.yaml")),
};

const NONE: Facts = without_metadata(
    "None",
    // `qemu`: libvirt and bare VMs, which have no metadata service.
    &["qemu"],
    &[],
    CONFIG_DRIVE,
    include_str!("../../../../deploy/policies/none.yaml"),
);

const VSPHERE: Facts = without_metadata(
    "VSphere",
    &["vmware"],
    &["vsphere"],
    CONFIG_DRIVE,
    include_str!("../../../../deploy/policies/vsphere.yaml"),
);

const OVIRT: Facts = without_metadata(
    "oVirt",
    // An oVirt node names no ignition id of its own.
    &[],
    &["ovirt"],
    CONFIG_DRIVE,
    include_str!("../../../../deploy/policies/ovirt.yaml"),
);

const IBMCLOUD: Facts = Facts {
    name: "IBMCloud",
    ignition_ids: &["ibmcloud"],
    // cloud-init names IBM Cloud by files on a config drive, not by DMI strings.
    dmi: &[],
    provider_ids: &["ibm", "ibmcloud"],
    metadata: &[svc("the VPC instance metadata service", "169.254.169.254/32", &[80, 443], TCP)],
    keep_open: &[],
    no_metadata_service: None,
    profiles: &[safe(
        &[
            put(
                "/instance_identity/v1/token",
                "the instance identity token, which opens the metadata service (older API \
                 versions)",
            ),
            put(
                "/identity/v1/token",
                "the instance identity token, which opens the metadata service (newer API \
                 versions)",
            ),
            get(
                "/metadata/v1/instance",
                "the instance document: id, name, CRN (with the account), zone, profile, VPC; \
                 no user data",
            ),
        ],
        &["version"],
    )],
    sensitive: &[
        never("/instance_identity/v1/iam_token", "an IAM token of the linked trusted profile"),
        never("/identity/v1/iam_tokens", "an IAM token of the linked trusted profile"),
        never("/instance_identity/v1/certificates", "the instance identity certificate"),
        never("/identity/v1/certificates", "the instance identity certificate"),
        never("/metadata/v1/instance/initialization", "user data, SSH keys, passwords"),
        never("/metadata/v1/keys", "SSH public keys"),
    ],
    proxy: ProxyFacts::NONE,
    shipped: Some(include_str!("../../../../deploy/policies/ibmcloud.yaml")),
};

const KUBEVIRT: Facts = without_metadata(
    "KubeVirt",
    &["kubevirt"],
    &["kubevirt"],
    CONFIG_DRIVE,
    include_str!("../../../../deploy/policies/kubevirt.yaml"),
);

const EQUINIXMETAL: Facts = without_metadata(
    "EquinixMetal",
    &["packet"],
    &["equinixmetal", "packet"],
    "Equinix Metal's metadata service was a public HTTPS name, shut down with the platform on \
     2026-06-30",
    include_str!("../../../../deploy/policies/equinixmetal.yaml"),
);

const POWERVS: Facts = without_metadata(
    "PowerVS",
    &["powervs"],
    &["ibmpowervs", "powervs"],
    CONFIG_DRIVE,
    include_str!("../../../../deploy/policies/powervs.yaml"),
);

const ALIBABACLOUD: Facts = Facts {
    name: "AlibabaCloud",
    ignition_ids: &["aliyun"],
    dmi: &[dmi(DmiField::ProductName, DmiTest::Is("Alibaba Cloud ECS"))],
    provider_ids: &["alicloud"],
    metadata: &[svc("the ECS instance metadata service", "100.100.100.200/32", &[80], TCP)],
    keep_open: &[
        svc("the VPC DNS server", "100.100.2.136/32", &[53], &[]),
        svc("the VPC DNS server", "100.100.2.138/32", &[53], &[]),
    ],
    no_metadata_service: None,
    profiles: &[safe(
        &[
            put("/latest/api/token", SESSION_TOKEN),
            get("/latest/meta-data/instance-id", "the instance id"),
            get("/latest/meta-data/region-id", "the region"),
            get("/latest/meta-data/zone-id", "the zone"),
            get("/latest/meta-data/instance/instance-type", "the instance type"),
        ],
        &[],
    )],
    sensitive: &[
        never("/latest/meta-data/ram/", "the RAM role's STS credentials"),
        never(
            "/latest/dynamic/instance-identity/",
            "the instance identity document and its pkcs7 signature",
        ),
        USER_DATA,
        PUBLIC_KEYS,
        never("/latest/meta-data/tags/", "instance tags, which users fill"),
    ],
    proxy: ProxyFacts::NONE,
    shipped: Some(include_str!("../../../../deploy/policies/alibabacloud.yaml")),
};

const NUTANIX: Facts = without_metadata(
    "Nutanix",
    &["nutanix"],
    &["nutanix"],
    CONFIG_DRIVE,
    include_str!("../../../../deploy/policies/nutanix.yaml"),
);

const EXTERNAL_OCI: Facts = Facts {
    name: "External/oci",
    ignition_ids: &["oraclecloud"],
    dmi: &[dmi(DmiField::ChassisAssetTag, DmiTest::Is("OracleCloud.com"))],
    provider_ids: &["oci"],
    metadata: &[
        svc("the OCI instance metadata service", "169.254.169.254/32", &[80], TCP),
        svc("the OCI instance metadata service (IPv6)", "fd00:c1::a9fe:a9fe/128", &[80], TCP),
    ],
    // The iSCSI boot and block volume targets (169.254.0.2, 169.254.2.0/24 port 3260) lie
    // in the OVN-Kubernetes masquerade subnet, which validation already rejects to protect.
    keep_open: &[
        svc("the VCN DNS resolver", "169.254.169.254/32", &[53], &[]),
        svc("the OCI NTP service", "169.254.169.254/32", &[123], UDP),
    ],
    no_metadata_service: None,
    profiles: &[safe(
        &[
            get("/opc/v2/instance/region", "the region"),
            get("/opc/v2/instance/availabilityDomain", "the availability domain"),
            get("/opc/v2/instance/id", "the instance OCID"),
            get("/opc/v2/instance/shape", "the shape"),
        ],
        &[],
    )],
    sensitive: &[
        never("/opc/v2/identity/", "the instance principal's certificate and private key"),
        never("/opc/v2/instance/metadata/", "SSH authorized keys and user data"),
        never("/opc/v1/", "the legacy tree, with the same data and no header check"),
        never("/openstack/", "the legacy tree"),
    ],
    proxy: ProxyFacts::NONE,
    shipped: Some(include_str!("../../../../deploy/policies/external-oci.yaml")),
};

const EXTERNAL_HETZNER: Facts = Facts {
    name: "External/hetzner",
    ignition_ids: &["hetzner"],
    dmi: &[dmi(DmiField::SysVendor, DmiTest::Is("Hetzner"))],
    // `hrobot`: a Robot (dedicated) server that the same cloud-controller-manager joined to the
    // cluster. It has no metadata service, but it is in a Hetzner cluster and takes its policy.
    provider_ids: &["hcloud", "hrobot"],
    metadata: &[
        svc("the Hetzner Cloud metadata service", "169.254.169.254/32", &[80], TCP),
        // Link-local, not in Hetzner's docs: cloud-init asks it first since it "prepares the
        // IPv6 Hetzner metadata-service". Protecting it costs nothing where it is absent.
        svc("the Hetzner Cloud metadata service (IPv6)", "fe80::a9fe:a9fe/128", &[80], TCP),
    ],
    // Hetzner's DNS resolvers and NTP servers are public addresses, nowhere near it.
    keep_open: &[],
    no_metadata_service: None,
    // The paths the CSI node plugin reads at start; private-networks (the HCCM's) tells a
    // workload the cluster's network layout and is left out.
    profiles: &[safe(
        &[
            get("/hetzner/v1/metadata/instance-id", "the server id"),
            get("/hetzner/v1/metadata/hostname", "the server's name"),
            get("/hetzner/v1/metadata/region", "the network zone (eu-central)"),
            get("/hetzner/v1/metadata/availability-zone", "the location and datacenter (hel1-dc2)"),
        ],
        &[],
    )],
    sensitive: &[
        never("/hetzner/v1/userdata", "user data (the node's Ignition config)"),
        never(
            "/hetzner/v1/metadata",
            "the whole document: the documented fields, and SSH public keys, network \
             configuration and vendor data",
        ),
        never("/hetzner/v1/metadata/public-keys", "SSH public keys"),
    ],
    proxy: ProxyFacts::NONE,
    shipped: Some(include_str!("../../../../deploy/policies/external-hetzner.yaml")),
};
