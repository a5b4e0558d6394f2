"""Kafka security settings: validated at load with errors that name the variable and never a
secret; aiokafka's keyword arguments and Faust's credentials agree (mechanism, user, TLS context
with the client certificate)."""

from __future__ import annotations

import dataclasses
import ssl

import faust
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
import pytest

from rlpulse.base.settings import Settings
from rlpulse.streams.app import _credentials
from tests.kafka_tls import make_certificates

SECRET = "pw-Zq81-never-shown"
# The bootstrap is given: unset, it would be the broker recorded in this checkout's home, on any port.
SASL = {"RLPULSE_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
        "RLPULSE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "RLPULSE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "RLPULSE_KAFKA_SASL_USERNAME": "alice", "RLPULSE_KAFKA_SASL_PASSWORD": SECRET}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory):
    return make_certificates(tmp_path_factory.mktemp("certs"), "keystore-pw", SECRET + "-key")


@pytest.mark.parametrize("env, message", [
    ({"RLPULSE_KAFKA_SECURITY_PROTOCOL": "TLS"},
     "RLPULSE_KAFKA_SECURITY_PROTOCOL: 'TLS' is not one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"),
    ({**SASL, "RLPULSE_KAFKA_SASL_MECHANISM": ""},
     "RLPULSE_KAFKA_SASL_MECHANISM is not set: SASL_SSL needs one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
    ({**SASL, "RLPULSE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "RLPULSE_KAFKA_SASL_MECHANISM": "GSSAPI"},
     "RLPULSE_KAFKA_SASL_MECHANISM is 'GSSAPI': SASL_PLAINTEXT needs one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
    ({**SASL, "RLPULSE_KAFKA_SASL_USERNAME": ""},
     "RLPULSE_KAFKA_SASL_USERNAME is not set: SASL_SSL with SCRAM-SHA-512 needs a username and a password"),
    ({**SASL, "RLPULSE_KAFKA_SASL_PASSWORD": ""},
     "RLPULSE_KAFKA_SASL_PASSWORD is not set: SASL_SSL with SCRAM-SHA-512 needs a username and a password"),
    ({**SASL, "RLPULSE_KAFKA_SECURITY_PROTOCOL": "SSL"},
     "RLPULSE_KAFKA_SASL_MECHANISM is SCRAM-SHA-512 but RLPULSE_KAFKA_SECURITY_PROTOCOL is SSL: SASL needs SASL_SSL"),
    ({"RLPULSE_KAFKA_SSL_CAFILE": "/etc/hostname"},
     "RLPULSE_KAFKA_SSL_CAFILE is set but RLPULSE_KAFKA_SECURITY_PROTOCOL is PLAINTEXT: TLS files are used with SSL or SASL_SSL"),
    ({**SASL, "RLPULSE_KAFKA_SSL_CAFILE": "/nonexistent/ca.pem"},
     "RLPULSE_KAFKA_SSL_CAFILE: /nonexistent/ca.pem does not exist or cannot be read"),
    ({**SASL, "RLPULSE_KAFKA_SSL_KEYFILE": "/etc/hostname"},
     "RLPULSE_KAFKA_SSL_KEYFILE is set without RLPULSE_KAFKA_SSL_CERTFILE: the key goes with a client certificate"),
])
def test_security_settings_that_cannot_work_are_refused_at_load_naming_the_variable(env, message):
    with pytest.raises(ValueError) as refused:
        Settings.load(env)
    assert message in str(refused.value)
    assert SECRET not in str(refused.value)


def test_protocol_and_mechanism_are_read_in_any_case():
    s = Settings.load({**SASL, "RLPULSE_KAFKA_SECURITY_PROTOCOL": "sasl_ssl", "RLPULSE_KAFKA_SASL_MECHANISM": "scram-sha-512"})
    assert (s.kafka_security_protocol, s.kafka_sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")


def test_passwords_are_in_no_repr_str_or_error(certs):
    s = Settings.load({**SASL, "RLPULSE_KAFKA_SSL_CAFILE": str(certs.ca), "RLPULSE_KAFKA_SSL_CERTFILE": str(certs.client_cert),
                       "RLPULSE_KAFKA_SSL_KEYFILE": str(certs.client_key),
                       "RLPULSE_KAFKA_SSL_KEY_PASSWORD": certs.client_key_password})
    assert SECRET not in repr(s) and SECRET not in str(s)
    assert SECRET not in repr(_credentials(s))
    wrong_key = dataclasses.replace(s, kafka_ssl_key_password=SECRET + "-wrong")
    with pytest.raises(ValueError) as refused:
        wrong_key.kafka_client_kwargs()
    assert f"cannot load the client certificate {certs.client_cert} with key {certs.client_key}" in str(refused.value)
    assert SECRET not in str(refused.value)


def test_aiokafka_and_faust_get_the_same_security(certs):
    s = Settings.load({**SASL, "RLPULSE_KAFKA_SSL_CAFILE": str(certs.ca), "RLPULSE_KAFKA_SSL_CERTFILE": str(certs.client_cert),
                       "RLPULSE_KAFKA_SSL_KEYFILE": str(certs.client_key),
                       "RLPULSE_KAFKA_SSL_KEY_PASSWORD": certs.client_key_password})
    kwargs = s.kafka_client_kwargs()
    assert {k: v for k, v in kwargs.items() if k != "ssl_context"} == {
        "bootstrap_servers": "127.0.0.1:9092", "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "alice", "sasl_plain_password": SECRET}
    faust_kwargs = credentials_to_aiokafka_auth(_credentials(s))  # what Faust hands its aiokafka clients
    assert {k: v for k, v in faust_kwargs.items() if k != "ssl_context"} == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "alice", "sasl_plain_password": SECRET}
    for context in (kwargs["ssl_context"], faust_kwargs["ssl_context"]):
        assert isinstance(context, ssl.SSLContext)
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
        assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "rlpulse test CA"),),)]

    mtls = Settings.load({"RLPULSE_KAFKA_SECURITY_PROTOCOL": "SSL", "RLPULSE_KAFKA_SSL_CAFILE": str(certs.ca)})
    assert isinstance(_credentials(mtls), faust.SSLCredentials)
    assert _credentials(Settings.load({})) is None
