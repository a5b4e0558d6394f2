"""Certificates for a test broker's TLS listeners, made with ``openssl`` in a temporary folder:
a CA, the broker's certificate (SAN 127.0.0.1 and localhost) in a PKCS12 keystore, and a client
certificate (CN=alice) whose key is encrypted with a password, for mTLS.

Passwords reach openssl through 0600 files (``-passin/-passout file:``), never its command line.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Certificates:
    ca: Path  # PEM: trusted by the clients (RLPULSE_KAFKA_SSL_CAFILE) and by the broker for client certificates
    keystore: Path  # PKCS12: the broker's key and certificate
    keystore_password: str = dataclasses.field(repr=False)
    client_cert: Path  # PEM, signed by the CA
    client_key: Path  # PEM, PKCS#8 encrypted with client_key_password
    client_key_password: str = dataclasses.field(repr=False)


def _secret_file(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return path


def _openssl(folder: Path, *args: str) -> None:
    run = subprocess.run(["openssl", *args], cwd=folder, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed (exit {run.returncode}): {run.stderr[-1000:]}")


def make_certificates(folder: Path, keystore_password: str, client_key_password: str) -> Certificates:
    """A CA, a broker certificate for 127.0.0.1/localhost and a client certificate, all valid for two days."""
    folder.mkdir(parents=True, exist_ok=True)
    _secret_file(folder / "keystore.pass", keystore_password)
    _secret_file(folder / "client.pass", client_key_password)
    _openssl(folder, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=rlpulse test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    (folder / "broker.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                       "extendedKeyUsage=serverAuth,clientAuth\n")
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subject in (("broker", "/CN=localhost"), ("client", "/CN=alice")):
        _openssl(folder, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subject)
        _openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    _openssl(folder, "pkcs12", "-export", "-in", "broker.pem", "-inkey", "broker.key", "-name", "broker",
             "-out", "broker.p12", "-passout", "file:keystore.pass")
    _openssl(folder, "pkcs8", "-topk8", "-in", "client.key", "-out", "client-encrypted.key", "-v2", "aes-256-cbc",
             "-passout", "file:client.pass")
    for path in folder.iterdir():
        path.chmod(0o600 if path.suffix in (".key", ".pass", ".p12") else 0o644)
    return Certificates(ca=folder / "ca.pem", keystore=folder / "broker.p12", keystore_password=keystore_password,
                        client_cert=folder / "client.pem", client_key=folder / "client-encrypted.key",
                        client_key_password=client_key_password)
