"""The DrafterService behind TLS (and mTLS) and an API key: RemoteDrafter with grpcs://, a CA and the key drafts;
a client without the key, the CA or a client certificate gets nothing; health probes need no key."""

from __future__ import annotations

import grpc
import pytest

pytest.importorskip("ray")
pytest.importorskip("cryptography")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from service_helpers import drafter_service  # noqa: E402
from stream_helpers import RawStream, open_req  # noqa: E402
from tls_helpers import self_signed  # noqa: E402

from stree.drafter_service.service import DrafterServer  # noqa: E402
from stree.proto.rpc import auth_metadata, channel_credentials, server_credentials, shared_loop  # noqa: E402
from stree.protocols import DraftBudget, SamplingParams  # noqa: E402
from stree.verifier.service.remote_drafter import DraftUnavailable, RemoteDrafter  # noqa: E402

KEY = "s3cret-key"
BUDGET = DraftBudget(max_nodes=8, max_depth=3, max_width=2)
TEXT = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    return {"server": self_signed(root, "server"), "client": self_signed(root, "client")}


@pytest.fixture(scope="module")
def service(certs):
    cert, key = certs["server"]
    with drafter_service(["ngram"], credentials=server_credentials(cert, key), api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def mtls_service(service, certs):
    """A second front on the same drafter pools that also wants a client certificate."""
    cert, key = certs["server"]
    front = DrafterServer(port=0, drafters=["ngram"], host=service.host,
                          credentials=server_credentials(cert, key, client_ca_file=certs["client"][0]))
    shared_loop().run(front.start(), 60)
    yield front
    shared_loop().run(front.stop(0, shutdown_pools=False), 30)


def _drafts(remote) -> bool:
    session = remote.open(TEXT, SamplingParams(), budget=BUDGET)
    try:
        return session.draft(BUDGET).num_nodes > 1
    finally:
        session.close()


def test_grpcs_with_ca_and_key_drafts(service, certs):
    remote = RemoteDrafter(f"grpcs://127.0.0.1:{service.port}/ngram", deadline_s=10.0, ca_file=certs["server"][0],
                           api_key=KEY)
    try:
        assert remote.name.startswith("grpcs://") and _drafts(remote)
    finally:
        remote.close()


def test_missing_or_wrong_key_is_unauthenticated(service, certs):
    creds = channel_credentials(certs["server"][0])
    for metadata in ((), auth_metadata("wrong")):
        with grpc.secure_channel(f"127.0.0.1:{service.port}", creds) as ch:
            stream = RawStream(ch, metadata=metadata).send(open_req((1, 2), "ngram"))
            with pytest.raises(grpc.RpcError) as info:
                stream.recv()
            stream.end()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in info.value.details()
    remote = RemoteDrafter(f"grpcs://127.0.0.1:{service.port}/ngram", deadline_s=10.0, ca_file=certs["server"][0],
                           api_key="wrong")
    try:
        with pytest.raises(ValueError, match="rejected the session: missing or wrong API key"):
            remote.open(TEXT, SamplingParams(), budget=BUDGET)
    finally:
        remote.close()


def test_health_probe_needs_no_key(service, certs):
    with grpc.secure_channel(f"127.0.0.1:{service.port}", channel_credentials(certs["server"][0])) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def _gets_no_drafts(remote) -> None:
    try:
        session = remote.open(TEXT, SamplingParams(), budget=BUDGET)
        with pytest.raises(DraftUnavailable):
            session.draft(BUDGET)
        session.close()
    finally:
        remote.close()


def test_plaintext_client_gets_no_drafts_from_a_tls_service(service):
    _gets_no_drafts(RemoteDrafter(f"grpc://127.0.0.1:{service.port}/ngram", deadline_s=0.5, api_key=KEY))


def test_mtls_needs_a_client_certificate(mtls_service, certs):
    ca = certs["server"][0]
    cert, key = certs["client"]
    remote = RemoteDrafter(f"grpcs://127.0.0.1:{mtls_service.port}/ngram", deadline_s=10.0, ca_file=ca,
                           cert_file=cert, key_file=key)
    try:
        assert _drafts(remote)
    finally:
        remote.close()
    _gets_no_drafts(RemoteDrafter(f"grpcs://127.0.0.1:{mtls_service.port}/ngram", deadline_s=0.5, ca_file=ca))


def test_half_a_client_certificate_is_refused(certs):
    with pytest.raises(ValueError, match="needs both cert_file and key_file"):
        channel_credentials(certs["server"][0], cert_file=certs["client"][0])
    with pytest.raises(ValueError, match="cannot read TLS certificate"):
        server_credentials("/nonexistent.crt", certs["server"][1])
