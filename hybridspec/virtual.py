"""The verifier of a virtual-clock run: the shipped engine, servicer and backend, in this process.

This is where both ends meet (netsim never imports cloud_verifier): the backend is built from the
same serve options a wall-clock run's verifier process gets (`cloud_verifier.cli`), under the
virtual clock, so its batcher has no thread; its passes charge the cost table's line
(netsim.virtual.costed.CostedPacker, inside the batcher's pass), its acceptance maths the table's
host path per row; the servicer's handlers are served by netsim.virtual.channel.InProcessServer.
Only batching backends run here (the shipped default): the serial verifier's turns wait on
threads.
"""
from __future__ import annotations

from dataclasses import dataclass

from netsim.virtual.channel import InProcessServer
from netsim.virtual.costed import CostedPacker
from netsim.virtual.costs import CostTable
from spec_core import clock


@dataclass
class InProcessVerifier:
    server: InProcessServer
    backend: object
    engine: object
    packer: CostedPacker

    def close(self) -> None:
        self.backend.close()


def make_verifier(serve_args: list[str], costs: CostTable) -> InProcessVerifier:
    """The verifier `cloud-verifier serve SERVE_ARGS` would run, in process, on the clock in force
    (a virtual one: spec_core.clock), its model time charged from `costs`."""
    from cloud_verifier.cli import backend_from_args, build_parser, limits_from_args, security_from_args
    from cloud_verifier.engine import VerifierEngine
    from cloud_verifier.server import VerifierServicer
    from spec_core import __version__
    from spec_core.proto import verifier_pb2_grpc as pb_grpc

    if not clock.inline():
        raise RuntimeError("make_verifier runs under a virtual clock (netsim.virtual.loop.run)")
    args = build_parser().parse_args(["serve", *serve_args])
    if args.kv_store not in (None, "off"):
        raise ValueError(f"the virtual clock runs without a KV store (--kv-store {args.kv_store}): its checkpoints "
                         "are written by a thread on the wall clock and outlive the run, so what a run restores "
                         "would depend on the runs before it and on this machine's timing")
    args.kv_store = "off"   # the default picks a shared folder on /dev/shm: never in a virtual run
    if args.batching != "on":
        raise ValueError("the virtual clock runs batching verifiers only (--batching on, the default): the serial "
                         "verifier takes its model in turns between threads")
    if args.backend == "synthetic":   # the table, not the synthetic backend's sleeps, says what a pass costs
        args.synthetic_step_ms = args.synthetic_per_token_ms = 0.0
    backend = backend_from_args(args)
    _, _, policy = security_from_args(args)
    batcher = getattr(backend, "batcher", None)
    if batcher is None or not batcher.inline:
        backend.close()
        raise ValueError(f"the {backend.info.name} backend has no inline batcher: it cannot run on the virtual clock")
    packer = CostedPacker(batcher.packer, costs)
    batcher.packer = packer
    _charge_acceptance(backend, costs)
    engine = VerifierEngine(backend, limits_from_args(args, backend), version=__version__,
                            evict_idle_after_s=policy.evict_idle_after_s)
    server = InProcessServer()
    pb_grpc.add_VerifierServicer_to_server(VerifierServicer(engine, policy), server)
    return InProcessVerifier(server, backend, engine, packer)


def _charge_acceptance(backend, costs: CostTable) -> None:
    """The round's maths after the pass (warping, accept/reject over the rows read; a cloud-only
    step's draw): the table's host_row_s a row, charged where it runs."""
    per_row = costs.verifier.host_row_s
    if per_row <= 0:
        return
    accept, sample_next = backend.accept, backend.sample_next

    def charged(logits, *args, **kwargs):
        clock.charge(per_row * len(logits))
        return accept(logits, *args, **kwargs)

    def sampled(*args, **kwargs):   # a cloud-only step: one row's warping and draw
        out = sample_next(*args, **kwargs)
        clock.charge(per_row)
        return out
    backend.accept, backend.sample_next = charged, sampled
