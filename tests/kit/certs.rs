//! A throwaway PKI for TLS tests: a CA, and server and client certificates it
//! signs. EC P-256 keys, so making them costs milliseconds.

use openssl::asn1::Asn1Time;
use openssl::bn::{BigNum, MsbOption};
use openssl::ec::{EcGroup, EcKey};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::x509::extension::{
    BasicConstraints, ExtendedKeyUsage, KeyUsage, SubjectAlternativeName,
};
use openssl::x509::{X509, X509Builder, X509Name, X509NameBuilder};

/// A certificate and its private key, as PEM.
pub struct Issued {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

pub struct Ca {
    cert: X509,
    key: PKey<Private>,
}

fn new_key() -> PKey<Private> {
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    PKey::from_ec_key(EcKey::generate(&group).unwrap()).unwrap()
}

fn name(common_name: &str) -> X509Name {
    let mut n = X509NameBuilder::new().unwrap();
    n.append_entry_by_nid(Nid::COMMONNAME, common_name).unwrap();
    n.build()
}

/// A builder for a one-day certificate of `key`, named `subject`.
fn builder(subject: &X509Name, key: &PKey<Private>) -> X509Builder {
    let mut b = X509Builder::new().unwrap();
    b.set_version(2).unwrap();
    let mut serial = BigNum::new().unwrap();
    serial.rand(64, MsbOption::MAYBE_ZERO, false).unwrap();
    b.set_serial_number(&serial.to_asn1_integer().unwrap())
        .unwrap();
    b.set_subject_name(subject).unwrap();
    b.set_pubkey(key).unwrap();
    // An hour back, in case the broker's clock reads a little behind.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    b.set_not_before(&Asn1Time::from_unix(now - 3600).unwrap())
        .unwrap();
    b.set_not_after(&Asn1Time::days_from_now(1).unwrap())
        .unwrap();
    b
}

impl Ca {
    /// A self-signed CA named `common_name`.
    pub fn new(common_name: &str) -> Ca {
        let key = new_key();
        let subject = name(common_name);
        let mut b = builder(&subject, &key);
        b.set_issuer_name(&subject).unwrap();
        b.append_extension(BasicConstraints::new().critical().ca().build().unwrap())
            .unwrap();
        b.append_extension(
            KeyUsage::new()
                .critical()
                .key_cert_sign()
                .crl_sign()
                .build()
                .unwrap(),
        )
        .unwrap();
        b.sign(&key, MessageDigest::sha256()).unwrap();
        Ca {
            cert: b.build(),
            key,
        }
    }

    pub fn cert_pem(&self) -> Vec<u8> {
        self.cert.to_pem().unwrap()
    }

    /// A server certificate for `dns_names` and `ips` (its subject alternative names).
    pub fn server(&self, dns_names: &[&str], ips: &[&str]) -> Issued {
        let mut san = SubjectAlternativeName::new();
        for d in dns_names {
            san.dns(d);
        }
        for ip in ips {
            san.ip(ip);
        }
        self.issue(dns_names.first().copied().unwrap_or("server"), |b| {
            let ctx = b.x509v3_context(Some(&self.cert), None);
            let san = san.build(&ctx).unwrap();
            b.append_extension(san).unwrap();
            b.append_extension(ExtendedKeyUsage::new().server_auth().build().unwrap())
                .unwrap();
        })
    }

    /// A client certificate naming `common_name`.
    pub fn client(&self, common_name: &str) -> Issued {
        self.issue(common_name, |b| {
            b.append_extension(ExtendedKeyUsage::new().client_auth().build().unwrap())
                .unwrap();
        })
    }

    fn issue(&self, common_name: &str, extend: impl FnOnce(&mut X509Builder)) -> Issued {
        let key = new_key();
        let mut b = builder(&name(common_name), &key);
        b.set_issuer_name(self.cert.subject_name()).unwrap();
        b.append_extension(BasicConstraints::new().build().unwrap())
            .unwrap();
        b.append_extension(
            KeyUsage::new()
                .critical()
                .digital_signature()
                .key_agreement()
                .build()
                .unwrap(),
        )
        .unwrap();
        extend(&mut b);
        b.sign(&self.key, MessageDigest::sha256()).unwrap();
        Issued {
            cert_pem: b.build().to_pem().unwrap(),
            key_pem: key.private_key_to_pem_pkcs8().unwrap(),
        }
    }
}
