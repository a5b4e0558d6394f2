"""Why a Kafka client cannot connect, in one line: the pre-flight check of every command and of the SDK.

aiokafka's clients swallow the reason a connection failed (a refused password, an untrusted
certificate) into ``KafkaConnectionError: Unable to bootstrap``, and retry. One connection made
here with the same settings (TLS handshake, SASL login) says what went wrong, so a wrong password
ends a command within seconds with a message naming what to fix, never the secret itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl

from aiokafka.conn import create_conn
from aiokafka.errors import (KafkaConnectionError, KafkaError, SaslAuthenticationFailed,
                             UnsupportedSaslMechanismError)

from rlpulse.base import env as envvars
from rlpulse.base.settings import Settings

CHECK_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ConnectionProblem:
    refused: bool  # the broker answered and refused us (credentials, TLS): retrying will not help
    message: str


def _hosts(bootstrap: str) -> list[tuple[str, int]]:
    out = []
    for entry in bootstrap.split(","):
        host, _, port = entry.strip().rpartition(":")
        if port.isdigit():
            out.append((host.strip("[]") or "127.0.0.1", int(port)))
    return out


def scrub(text: str, settings: Settings) -> str:
    """``text`` with the SASL and key passwords masked: nothing we print may carry them."""
    for secret in (settings.kafka_sasl_password, settings.kafka_ssl_key_password):
        if secret:
            text = text.replace(secret, "***")
    return text


def _explain(exc: BaseException, where: str, s: Settings) -> ConnectionProblem:
    protocol = s.kafka_security_protocol
    if isinstance(exc, SaslAuthenticationFailed):
        return ConnectionProblem(True, f"Kafka at {where} refused the credentials: SASL authentication of user "
                                 f"{s.kafka_sasl_username!r} with {s.kafka_sasl_mechanism} failed "
                                 f"({exc.args[0] if exc.args else exc}). Check {envvars.KAFKA_SASL_USERNAME} "
                                 f"and {envvars.KAFKA_SASL_PASSWORD}")
    if isinstance(exc, UnsupportedSaslMechanismError):
        return ConnectionProblem(True, f"Kafka at {where} does not accept SASL mechanism {s.kafka_sasl_mechanism}: "
                                 f"{exc.args[0] if exc.args else exc}. Set {envvars.KAFKA_SASL_MECHANISM} to one it accepts")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ConnectionProblem(True, f"TLS to Kafka at {where} failed: the broker's certificate is not trusted "
                                 f"({exc.verify_message}). Set {envvars.KAFKA_SSL_CAFILE} to the CA that signed it")
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or str(exc)
        hint = (f"the broker wants a client certificate: set {envvars.KAFKA_SSL_CERTFILE} and {envvars.KAFKA_SSL_KEYFILE}"
                if "CERTIFICATE_REQUIRED" in reason.upper() else
                f"does the listener at {where} speak {protocol}? {envvars.KAFKA_SECURITY_PROTOCOL} must match it")
        return ConnectionProblem(True, f"TLS to Kafka at {where} failed ({reason}): {hint}")
    if isinstance(exc, (KafkaConnectionError, ConnectionResetError)) and "SSL" in protocol and s.kafka_ssl_certfile == "":
        return ConnectionProblem(True, f"Kafka at {where} closed the TLS connection during the handshake: if the "
                                 "listener demands client certificates (ssl.client.auth=required), set "
                                 f"{envvars.KAFKA_SSL_CERTFILE} and {envvars.KAFKA_SSL_KEYFILE}; else check that the "
                                 f"listener speaks {protocol} ({exc})")
    if isinstance(exc, (KafkaConnectionError, asyncio.TimeoutError)) and protocol != "PLAINTEXT":
        return ConnectionProblem(True, f"Kafka at {where} did not complete the {protocol} handshake ({type(exc).__name__}"
                                 f"{': ' + str(exc) if str(exc) else ''}): check that the listener speaks {protocol}")
    if isinstance(exc, KafkaConnectionError) and protocol == "PLAINTEXT" and "closed" in str(exc):
        return ConnectionProblem(True, f"Kafka at {where} closed the connection: it may want TLS or SASL "
                                 f"(set {envvars.KAFKA_SECURITY_PROTOCOL} and the credentials)")
    return ConnectionProblem(False, f"no Kafka broker answers at {where} ({type(exc).__name__}: {exc})")


async def connection_problem(settings: Settings, timeout: float = CHECK_TIMEOUT_S) -> ConnectionProblem | None:
    """None once one bootstrap server accepts a connection with ``settings``' security (the TLS
    handshake and the SASL login done); else the first refusal, or why none answered."""
    kwargs = settings.kafka_client_kwargs()
    kwargs.pop("bootstrap_servers")
    problem = None
    for host, port in _hosts(settings.kafka_bootstrap):
        conn = None
        try:
            conn = await asyncio.wait_for(create_conn(host, port, request_timeout_ms=int(timeout * 1000), **kwargs),
                                          timeout)
            return None
        except (OSError, KafkaError, asyncio.TimeoutError) as exc:
            found = _explain(exc, f"{host}:{port}", settings)
            found = dataclasses.replace(found, message=scrub(found.message, settings))
            if found.refused:
                return found
            problem = problem or found
        finally:
            if conn is not None:
                conn.close()
    return problem or ConnectionProblem(False, f"no host:port in the bootstrap list {settings.kafka_bootstrap!r}")


def check_connection(settings: Settings, timeout: float = CHECK_TIMEOUT_S) -> ConnectionProblem | None:
    """:func:`connection_problem` from synchronous code."""
    return asyncio.run(connection_problem(settings, timeout))
