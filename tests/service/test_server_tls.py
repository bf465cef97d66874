"""gRPC over TLS: a server given a certificate and key answers a TLS client and nothing in plaintext."""

from __future__ import annotations

import datetime

import grpc
import pytest

x509 = pytest.importorskip("cryptography.x509")

from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from service_helpers import TinyStack  # noqa: E402
from stree.proto.rpc import shared_loop  # noqa: E402
from stree.proto.stree.v1 import generation_pb2_grpc  # noqa: E402
from stree.verifier.decode.loop import generate  # noqa: E402
from stree.verifier.service.client import Client  # noqa: E402
from stree.verifier.service.server import GenerationServer, ServerLimits  # noqa: E402


def _self_signed() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


def test_tls_server_answers_tls_clients_only(tmp_path):
    s = TinyStack(tmp_path, seed=12, n_layer=1)
    cert, key = _self_signed()
    server = GenerationServer(s.model, s.tok, tls=(cert, key), limits=ServerLimits(max_sessions=2, max_seq_len=128))
    loop = shared_loop()
    loop.run(server.start())
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        opts = [("grpc.ssl_target_name_override", "localhost")]
        with grpc.secure_channel(server.address, creds, options=opts) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            out = stub.GenerateUnary(Client.request(prompt_ids=[3, 4], max_new_tokens=5), timeout=60)
        assert list(out.token_ids) == generate(s.model, [3, 4], max_new_tokens=5).token_ids
        with grpc.insecure_channel(server.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.RpcError):
                stub.GenerateUnary(Client.request(prompt_ids=[3, 4], max_new_tokens=5), timeout=10)
    finally:
        loop.run(server.stop(0), 30)
