"""The bench's Java tools (ProducerPerformance, ConsumerPerformance) get the settings' TLS and
SASL through a 0600 properties file in a private temp folder, removed after the run: the
password never goes on their command line."""

from __future__ import annotations

import stat
import tempfile
from pathlib import Path

import pytest

from bench.kafka_perf import PerfError, client_config, client_properties
from rlpulse.base.settings import Settings
from tests.kafka_tls import make_certificates

# a quote, a backslash, a non-Latin-1 letter and one outside the BMP: each escaped twice (JAAS, then properties)
PASSWORD = 'pw"\\ö€𝄞-x'
SASL = {"RLPULSE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "RLPULSE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "RLPULSE_KAFKA_SASL_USERNAME": "alice", "RLPULSE_KAFKA_SASL_PASSWORD": PASSWORD}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory):
    return make_certificates(tmp_path_factory.mktemp("certs"), "keystore-pw", "client-key-pw")


def test_plaintext_needs_no_file() -> None:
    with client_config(Settings.load({})) as path:
        assert path is None


def test_sasl_ssl_properties_file_is_private_escaped_and_removed(certs) -> None:
    settings = Settings.load({**SASL, "RLPULSE_KAFKA_SSL_CAFILE": str(certs.ca)})
    with client_config(settings) as path:
        assert path is not None
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        lines = path.read_text(encoding="ascii").splitlines()
        folder = path.parent
    assert lines == [
        "security.protocol=SASL_SSL",
        "sasl.mechanism=SCRAM-SHA-512",
        'sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="alice" '
        'password="pw\\\\"\\\\\\\\\\u00f6\\u20ac\\ud834\\udd1e-x";',
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={certs.ca}",
    ]
    assert not folder.exists()


def test_plain_mechanism_uses_the_plain_login_module(certs) -> None:
    settings = Settings.load({**SASL, "RLPULSE_KAFKA_SASL_MECHANISM": "PLAIN", "RLPULSE_KAFKA_SASL_PASSWORD": "s3"})
    props = client_properties(settings, Path("/nonexistent"))
    assert props["sasl.jaas.config"] == ('org.apache.kafka.common.security.plain.PlainLoginModule required '
                                         'username="alice" password="s3";')
    assert "ssl.truststore.location" not in props  # no CA file: the JVM's own CAs


def mtls(certs, key_password: str) -> Settings:
    return Settings.load({"RLPULSE_KAFKA_SECURITY_PROTOCOL": "SSL", "RLPULSE_KAFKA_SSL_CAFILE": str(certs.ca),
                          "RLPULSE_KAFKA_SSL_CERTFILE": str(certs.client_cert),
                          "RLPULSE_KAFKA_SSL_KEYFILE": str(certs.client_key), "RLPULSE_KAFKA_SSL_KEY_PASSWORD": key_password})


def test_mtls_puts_the_decrypted_key_and_the_certificate_in_one_private_pem_keystore(certs) -> None:
    # The test key is PBES2 (AES-256) encrypted, which Kafka's PEM keystore cannot read: it goes in decrypted.
    assert certs.client_key.read_text().startswith("-----BEGIN ENCRYPTED PRIVATE KEY-----")
    with client_config(mtls(certs, certs.client_key_password)) as path:
        assert path is not None
        keystore = path.parent / "client-keystore.pem"
        assert path.read_text().splitlines() == [
            "security.protocol=SSL", "ssl.truststore.type=PEM", f"ssl.truststore.location={certs.ca}",
            "ssl.keystore.type=PEM", f"ssl.keystore.location={keystore}"]
        assert stat.S_IMODE(keystore.stat().st_mode) == 0o600
        pem = keystore.read_text()
        assert pem.startswith("-----BEGIN PRIVATE KEY-----")
        assert pem.count("-----BEGIN PRIVATE KEY-----") == 1 and "ENCRYPTED" not in pem
        assert pem.endswith(certs.client_cert.read_text().strip() + "\n")
    assert not keystore.exists()


def test_mtls_with_a_wrong_key_password_says_so_without_it(certs) -> None:
    with pytest.raises(PerfError) as err:
        with client_config(mtls(certs, "not-the-key-password")):
            pass
    assert str(err.value).startswith(f"openssl could not read the client key {certs.client_key} with "
                                     "RLPULSE_KAFKA_SSL_KEY_PASSWORD (")
    assert "not-the-key-password" not in str(err.value)
    assert not list(Path(tempfile.gettempdir()).glob("rlpulse-bench-client-*"))
