//! Cluster identities: a cluster certificate authority and one certificate per node, and the
//! mutual-TLS configurations every cluster connection uses. There is no plaintext mode: a peer
//! without a certificate from this cluster's authority is refused by the TLS handshake.
//!
//! A cluster directory holds `ca.pem` (the authority's certificate), `ca.key` (its key, to add
//! nodes later) and, per node, `NODE.pem` and `NODE.key`. Keys are written with mode 0600.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// ALPN name of the cluster protocol.
pub const ALPN: &[u8] = b"charm-cluster/1";

/// Why cluster identities could not be made or loaded.
pub type TlsError = crate::FileError;

use crate::io_at as io;

fn invalid(e: impl std::fmt::Display) -> TlsError {
    TlsError::Invalid(e.to_string())
}

/// Whether `name` can name a node: letters, digits, `-` and `.`, 1 to 63 characters, starting
/// with a letter or digit (it becomes a DNS name in the node's certificate and a file name).
pub fn valid_node_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
}

fn write_new(path: &Path, text: &str, mode: u32) -> Result<(), TlsError> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(io(path))?;
    f.write_all(text.as_bytes()).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

/// Makes a cluster authority in `dir` (which must not hold one yet) and a certificate for each
/// of `nodes`. Returns the files written.
pub fn init_cluster(dir: &Path, nodes: &[String]) -> Result<Vec<PathBuf>, TlsError> {
    for n in nodes {
        if !valid_node_name(n) {
            return Err(TlsError::Invalid(format!(
                "node name `{n}`: use 1-63 letters, digits, `-` or `.`, starting with a letter or digit"
            )));
        }
    }
    let ca_pem = dir.join("ca.pem");
    if ca_pem.exists() {
        return Err(TlsError::Invalid(format!(
            "{} exists: this directory already holds a cluster",
            ca_pem.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let ca_key = KeyPair::generate().map_err(invalid)?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(invalid)?;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params
        .distinguished_name
        .push(DnType::CommonName, "charm cluster authority");
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = params.self_signed(&ca_key).map_err(invalid)?;
    let mut written = vec![];
    write_new(&ca_pem, &ca.pem(), 0o644)?;
    written.push(ca_pem);
    let key_path = dir.join("ca.key");
    write_new(&key_path, &ca_key.serialize_pem(), 0o600)?;
    written.push(key_path);
    let issuer = Issuer::new(params, ca_key);
    for n in nodes {
        written.extend(add_node_with(dir, n, &issuer)?);
    }
    Ok(written)
}

/// Adds a certificate for node `name` to the cluster in `dir`, signed by its authority.
pub fn add_node(dir: &Path, name: &str) -> Result<Vec<PathBuf>, TlsError> {
    if !valid_node_name(name) {
        return Err(TlsError::Invalid(format!("node name `{name}`")));
    }
    let read = |p: PathBuf| std::fs::read_to_string(&p).map_err(io(&p));
    let key = KeyPair::from_pem(&read(dir.join("ca.key"))?).map_err(invalid)?;
    let issuer = Issuer::from_ca_cert_pem(&read(dir.join("ca.pem"))?, key).map_err(invalid)?;
    add_node_with(dir, name, &issuer)
}

fn add_node_with(
    dir: &Path,
    name: &str,
    issuer: &Issuer<'_, KeyPair>,
) -> Result<Vec<PathBuf>, TlsError> {
    let key = KeyPair::generate().map_err(invalid)?;
    let mut params = CertificateParams::new(vec![name.to_string()]).map_err(invalid)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let cert = params.signed_by(&key, issuer).map_err(invalid)?;
    let (pem, kp) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    write_new(&pem, &cert.pem(), 0o644)?;
    write_new(&kp, &key.serialize_pem(), 0o600)?;
    Ok(vec![pem, kp])
}

/// A node's identity: its certificate and key, and the cluster authority it trusts.
#[derive(Debug)]
pub struct Identity {
    pub node: String,
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
}

impl Identity {
    /// Loads node `node`'s identity from cluster directory `dir`.
    pub fn load(dir: &Path, node: &str) -> Result<Self, TlsError> {
        if !valid_node_name(node) {
            return Err(TlsError::Invalid(format!("node name `{node}`")));
        }
        let read = |p: PathBuf| std::fs::read(&p).map_err(io(&p));
        let named = |p: &str| {
            let p = p.to_string();
            move |e: rustls::pki_types::pem::Error| TlsError::Invalid(format!("{p}: {e}"))
        };
        let ca =
            CertificateDer::from_pem_slice(&read(dir.join("ca.pem"))?).map_err(named("ca.pem"))?;
        let cert = CertificateDer::from_pem_slice(&read(dir.join(format!("{node}.pem")))?)
            .map_err(named(&format!("{node}.pem")))?;
        let key = PrivateKeyDer::from_pem_slice(&read(dir.join(format!("{node}.key")))?)
            .map_err(named(&format!("{node}.key")))?;
        Ok(Self {
            node: node.to_string(),
            ca,
            cert,
            key,
        })
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.clone()).map_err(invalid)?;
        Ok(Arc::new(roots))
    }

    /// Server side: TLS 1.3, client certificates required and checked against the authority.
    pub fn server_config(&self) -> Result<quinn::ServerConfig, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            self.roots()?,
            provider.clone(),
        )
        .build()
        .map_err(invalid)?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(invalid)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(invalid)?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        let q = quinn::crypto::rustls::QuicServerConfig::try_from(cfg).map_err(invalid)?;
        Ok(quinn::ServerConfig::with_crypto(Arc::new(q)))
    }

    /// Client side: TLS 1.3, the server's certificate checked against the authority and the
    /// node name dialled, this node's certificate presented.
    pub fn client_config(&self) -> Result<quinn::ClientConfig, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(invalid)?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(invalid)?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        let q = quinn::crypto::rustls::QuicClientConfig::try_from(cfg).map_err(invalid)?;
        Ok(quinn::ClientConfig::new(Arc::new(q)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_cluster_is_made_once_with_private_keys() {
        let dir = std::env::temp_dir().join(format!("charm-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let nodes = vec!["coordinator".to_string(), "w1".to_string()];
        let files = init_cluster(&dir, &nodes).unwrap();
        assert_eq!(files.len(), 6);
        for f in &files {
            let mode = std::fs::metadata(f).unwrap().permissions().mode() & 0o777;
            let key = f.extension().is_some_and(|e| e == "key");
            assert_eq!(mode, if key { 0o600 } else { 0o644 }, "{}", f.display());
        }
        assert!(
            init_cluster(&dir, &nodes).is_err(),
            "a second init overwrote the cluster"
        );
        add_node(&dir, "w2").unwrap();
        for n in ["coordinator", "w1", "w2"] {
            let id = Identity::load(&dir, n).unwrap();
            id.server_config().unwrap();
            id.client_config().unwrap();
        }
        assert!(add_node(&dir, "../x").is_err());
        assert!(Identity::load(&dir, "w9").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
