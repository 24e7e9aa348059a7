"""Container health check: ask a verifier's gRPC health service, or just open a TCP connection.

    python healthcheck.py                                   # 127.0.0.1:50051, hybridspec.v1.Verifier
    python healthcheck.py --addr 127.0.0.1:50051 --service ""   # the server as a whole
    python healthcheck.py --tcp --addr 127.0.0.1:50052      # a plain TCP listener (the netsim proxy)
    python healthcheck.py --tls-ca /etc/hybridspec/tls/ca.crt --tls-server-name verifier   # over TLS

Over TLS the check trusts --tls-ca and checks the certificate against --tls-server-name (the
name the certificate was made for, since the check dials 127.0.0.1); with mutual TLS give it a
client certificate and key too. The health service needs no bearer token.

Exit status 0 when SERVING (or the port accepts a connection), 1 otherwise, with one line on
stderr that says why: Docker shows it in `docker inspect`. A stand-in for grpc_health_probe,
which is a downloaded binary; it needs only grpcio and grpcio-health-checking, which the image
already has.
"""
from __future__ import annotations

import argparse
import socket
import sys

SERVICE = "hybridspec.v1.Verifier"


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def grpc_status(addr: str, service: str, timeout_s: float, tls_ca: str | None = None,
                tls_server_name: str | None = None, tls_cert: str | None = None, tls_key: str | None = None) -> str:
    """The health service's answer for `service` ("SERVING", "NOT_SERVING", ...), or the RPC error."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls_ca:
        creds = grpc.ssl_channel_credentials(_read(tls_ca), _read(tls_key), _read(tls_cert))
        options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
        channel = grpc.secure_channel(addr, creds, options=options)
    else:
        channel = grpc.insecure_channel(addr)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def tcp_status(addr: str, timeout_s: float) -> str:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return "SERVING"
    except OSError as e:
        return f"connect failed: {e}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT to check")
    p.add_argument("--service", default=SERVICE, help="gRPC health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.add_argument("--tcp", action="store_true", help="only check that the port accepts a TCP connection")
    p.add_argument("--tls-ca", help="PEM CA bundle: connect with TLS and trust this CA")
    p.add_argument("--tls-server-name", help="name to check the server's certificate against")
    p.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status = tcp_status(args.addr, args.timeout) if args.tcp else grpc_status(
        args.addr, args.service, args.timeout, args.tls_ca, args.tls_server_name, args.tls_cert, args.tls_key)
    if status == "SERVING":
        return 0
    print(f"unhealthy: {args.addr} {'(tcp)' if args.tcp else repr(args.service)}: {status}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
