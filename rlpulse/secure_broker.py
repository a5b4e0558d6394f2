"""Secure listeners for the local broker: SASL_SSL with SCRAM-SHA-512, and SSL that demands a
client certificate (mTLS), opened beside its PLAINTEXT listener by ``services.up(settings, tls)``.

This is how the clients are tested against a broker that demands TLS and SASL
(tests/integration/rlpulse/test_kafka_security.py; tests/kafka_tls.py makes the certificates with
openssl). The controller and the broker's own traffic stay on PLAINTEXT, so SCRAM users are
created through that listener with Kafka's own ConfigCommand. This module stands on
``rlpulse.kafka_jvm`` only: ``services`` names :class:`TlsListeners` as a type, not the reverse.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import uuid
from pathlib import Path

from rlpulse import kafka_jvm
from rlpulse.base.settings import Settings


@dataclasses.dataclass(frozen=True)
class TlsListeners:
    """Secure listeners the local broker opens beside PLAINTEXT, to run the clients against a
    broker that demands TLS and SASL (tests/integration/rlpulse/test_kafka_security.py makes the
    certificates). The controller and the broker's own traffic stay on PLAINTEXT.

    * ``sasl_ssl_port``: SASL_SSL with SCRAM-SHA-512; users come from :func:`add_scram_user`;
      client certificates are asked for only with ``sasl_ssl_client_auth``.
    * ``ssl_port``: SSL that demands a client certificate signed by the truststore's CA (mTLS).
    """

    keystore: Path  # PKCS12: the broker's key and certificate (SAN 127.0.0.1 / localhost)
    keystore_password: str = dataclasses.field(repr=False)
    truststore: Path  # PEM: the CA that signs client certificates
    sasl_ssl_port: int | None = None
    ssl_port: int | None = None
    sasl_ssl_client_auth: bool = False

    def properties(self, host: str) -> tuple[list[str], list[str], str]:
        """(listeners, their security protocol map entries, the listeners' TLS and SASL settings)."""
        listeners, protocols, lines = [], [], []
        tls = ("ssl.keystore.type=PKCS12", f"ssl.keystore.location={self.keystore}",
               f"ssl.keystore.password={self.keystore_password}", "ssl.truststore.type=PEM",
               f"ssl.truststore.location={self.truststore}")
        if self.sasl_ssl_port is not None:
            listeners.append(f"SASL_SSL://{host}:{self.sasl_ssl_port}")
            protocols.append("SASL_SSL:SASL_SSL")
            lines += [f"listener.name.sasl_ssl.{line}" for line in tls]
            lines += ["listener.name.sasl_ssl.sasl.enabled.mechanisms=SCRAM-SHA-512",
                      "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config="
                      "org.apache.kafka.common.security.scram.ScramLoginModule required;",
                      f"listener.name.sasl_ssl.ssl.client.auth={'required' if self.sasl_ssl_client_auth else 'none'}"]
        if self.ssl_port is not None:
            listeners.append(f"SSL://{host}:{self.ssl_port}")
            protocols.append("SSL:SSL")
            lines += [f"listener.name.ssl.{line}" for line in tls] + ["listener.name.ssl.ssl.client.auth=required"]
        return listeners, protocols, "".join(f"{line}\n" for line in lines)


def add_scram_user(settings: Settings, user: str, password: str, mechanism: str = "SCRAM-SHA-512") -> None:
    """Create (or reset) SCRAM user ``user`` on the local broker, through its PLAINTEXT listener
    at ``settings.kafka_bootstrap``, with Kafka's own ConfigCommand.

    The password goes to the tool in a 0600 file (``--add-config-file``), never on a command line
    that ``ps`` shows; the file is removed once the tool is done.
    """
    if not password or any(c in password for c in ",[]=\\\n\r"):
        raise ValueError("a SCRAM password for the local broker must be non-empty, without , [ ] = \\ or line breaks")
    libs = kafka_jvm.fetch_jars(settings)
    kdir = kafka_jvm.kafka_dir(settings)
    secret = kdir / f"scram-{uuid.uuid4().hex}.properties"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{mechanism}=iterations=8192,password={password}\n")  # a properties file: no [ ] as on --add-config
        cmd = ["java", f"-Dlog4j.configuration=file:{kdir / 'log4j.properties'}", "-cp", f"{libs}/*",
               "kafka.admin.ConfigCommand", "--bootstrap-server", settings.kafka_bootstrap, "--alter",
               "--entity-type", "users", "--entity-name", user, "--add-config-file", str(secret)]
        run = subprocess.run(cmd, capture_output=True, text=True, env=kafka_jvm.jvm_env(), timeout=120)
    finally:
        secret.unlink(missing_ok=True)
    if run.returncode != 0:
        output = (run.stdout + run.stderr).replace(password, "***")
        raise kafka_jvm.ServicesError(f"creating SCRAM user {user!r} failed (exit {run.returncode}):\n{output[-2000:]}")
