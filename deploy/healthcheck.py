"""Container health check: ask a verifier's gRPC health service, or just open a TCP connection.

    python healthcheck.py                                   # 127.0.0.1:50051, hybridspec.v1.Verifier
    python healthcheck.py --addr 127.0.0.1:50051 --service ""   # the server as a whole
    python healthcheck.py --tcp --addr 127.0.0.1:50052      # a plain TCP listener (the netsim proxy)

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


def grpc_status(addr: str, service: str, timeout_s: float) -> str:
    """The health service's answer for `service` ("SERVING", "NOT_SERVING", ...), or the RPC error."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as channel:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT to check")
    p.add_argument("--service", default=SERVICE, help="gRPC health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.add_argument("--tcp", action="store_true", help="only check that the port accepts a TCP connection")
    args = p.parse_args(argv)
    status = tcp_status(args.addr, args.timeout) if args.tcp else grpc_status(args.addr, args.service, args.timeout)
    if status == "SERVING":
        return 0
    print(f"unhealthy: {args.addr} {'(tcp)' if args.tcp else repr(args.service)}: {status}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
