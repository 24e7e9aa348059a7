"""The virtual clock (netsim.virtual): its loop, its accounting, its link, and that the same seed and
cost table give the same results file byte for byte, also beside two CPU burners.

Cost: ~2 s in process, plus two `netsim experiment --clock virtual --synthetic` runs of 16 tokens
(~3 s each on an idle 2-core machine, longer beside the burners).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netsim.effects import Bandwidth, Delay
from netsim.link import Link
from netsim.profiles import Profile
from netsim.virtual import loop as vloop
from netsim.virtual.costs import CostTable, shipped_tables, synthetic_table
from spec_core import clock

ROOT = Path(__file__).resolve().parents[2]


def test_the_loop_jumps_to_timers_and_waits_out_inline_charges():
    async def main():
        order = []

        async def sleeper():
            await asyncio.sleep(1.5)
            order.append(("slept", clock.now()))

        async def worker():
            def work():
                clock.charge(0.7)
                return clock.now()          # inside the work: the charge counts already
            inside = await clock.run_inline(work)
            order.append(("worked", clock.now(), inside))
        await asyncio.gather(sleeper(), worker())
        try:
            await asyncio.wait_for(asyncio.sleep(10), 2.0)
        except asyncio.TimeoutError:
            order.append(("timeout", clock.now()))
        return order
    assert vloop.run(main) == [("worked", 0.7, 0.7), ("slept", 1.5), ("timeout", 3.5)]


def test_a_loop_that_waits_for_itself_says_so():
    async def main():
        await asyncio.get_running_loop().create_future()   # nothing will ever set it
    with pytest.raises(vloop.VirtualStall):
        vloop.run(main)


def test_a_charge_nobody_waits_out_is_an_error():
    async def main():
        clock.charge(0.1)          # outside run_inline: the loop would lose it
        await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="outside spec_core.clock.run_inline"):
        vloop.run(main)


def test_the_wall_clock_is_the_default_outside_a_virtual_run():
    assert not clock.inline()
    t0 = clock.now()
    clock.charge(100.0)            # ignored: the wall clock's work takes its own time
    assert clock.now() - t0 < 1.0


def test_a_message_crosses_the_link_in_delay_plus_its_bytes_over_the_rate():
    from netsim.virtual.channel import LinkCounts, VirtualConnection
    profile = Profile("t", Link((Delay(50), Bandwidth(80))), Link((Delay(50),)))   # 80 kbit/s = 10 bytes/ms

    async def main():
        conn = VirtualConnection(profile, seed=0, number=0, epoch_s=0.0, counts=LinkCounts())
        await conn.carry("up", 1000)        # 50 ms + 100 ms
        first = clock.now()
        await conn.carry("down", 1000)      # 50 ms, no rate limit down
        return first, clock.now(), conn.counts.bytes_up
    first, second, up = vloop.run(main)
    assert first == pytest.approx(0.150) and second == pytest.approx(0.200) and up == 1000


def _one_run(mode: str, costs: CostTable, gamma: int = 4, tokens: int = 48):
    from hybridspec.virtual import make_verifier
    from netsim.experiment import ExperimentConfig, Runner
    from netsim.virtual.channel import InProcessChannel
    from netsim.virtual.experiment import costed_client
    empty = Profile("empty", Link(()), Link(()))

    async def main():
        runner = Runner(ExperimentConfig(profiles=[], modes=[], out=Path("."), synthetic=True, synthetic_draft_ms=0))
        verifier = make_verifier(runner.verifier_args(), costs)
        try:
            channel = InProcessChannel(verifier.server, empty, costs)
            st, _ = await runner.run_on(channel, "in-process", mode, gamma, runner.prompt_ids("p"),
                                        runner.settings("chat", tokens), None, client_class=costed_client(costs))
            return st, verifier.packer.passes, verifier.packer.tokens
        finally:
            verifier.close()
    return vloop.run(main)


def test_a_chain_round_costs_its_drafting_and_its_pass_exactly():
    # No link and no host path: the run's virtual time is the table's drafting and passes, nothing else.
    costs = synthetic_table(draft_row_s=0.010, pass_base_s=0.020, per_token_s=0.001)
    st, passes, pass_tokens = _one_run("hybrid", costs)
    assert st.tokens == 48 and passes == st.rounds
    assert st.wall_s == pytest.approx(st.draft_s + 0.020 * passes + 0.001 * pass_tokens)
    assert st.draft_s == pytest.approx(0.010 * st.drafted)


def test_stepped_work_sees_what_happened_on_the_loop_after_each_charge():
    # Drafting during a round trip stops once the reply is in: run stepped, each 0.1 s step is waited
    # out before the next look at `stop`, which a timer sets at 0.25 s. Inline (not stepped) the
    # work cannot see it: the negative control.
    import threading

    def work(stop: threading.Event) -> list[float]:
        seen = []
        while not stop.is_set() and len(seen) < 10:
            clock.charge(0.1)
            seen.append(round(clock.now(), 6))
        return seen

    def run(stepped: bool):
        async def main():
            stop = threading.Event()
            asyncio.get_running_loop().call_later(0.25, stop.set)
            return await clock.run_inline(work, stop, stepped=stepped)
        return vloop.run(main)
    assert run(stepped=True) == [0.1, 0.2, 0.3]
    assert len(run(stepped=False)) == 10


def test_the_shipped_tables_say_where_they_come_from():
    from netsim.virtual.published import published_tables
    tables = shipped_tables()
    for made in published_tables():   # the files are what the generator writes (python -m netsim.virtual.published)
        assert tables[made.name] == made, f"netsim/virtual/tables/{made.name}.json is stale"
        assert not made.measured and "Not measured here" in made.source or made.name == "flat-gpu"
    assert all(t.source for t in tables.values())
    assert not any(t.busy for t in tables.values()), "a table measured on a busy machine must not ship"
    provisional = [t for t in tables.values() if t.provisional]
    assert all(not t.measured for t in provisional)


def _experiment(out: Path, hash_seed: str) -> bytes:
    cmd = [sys.executable, "-m", "netsim", "experiment", "--clock", "virtual", "--synthetic", "--profiles", "3g,flaky",
           "--modes", "cloud-only,per-token,hybrid,tree,pipeline,window,fused,auto", "--workloads", "chat",
           "--max-tokens", "16", "--seed", "3", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONHASHSEED": hash_seed})
    return (out / "results.json").read_bytes()


def test_the_same_seed_and_table_give_the_same_bytes_beside_two_cpu_burners(tmp_path):
    quiet = _experiment(tmp_path / "quiet", "1")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = _experiment(tmp_path / "busy", "2")
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert quiet == busy
    result = json.loads(quiet)
    assert result["clock"] == "virtual" and result["cost_table"]["name"].startswith("synthetic")
    assert len(result["rows"]) == 16 and all(r["tokens"] == 16 for r in result["rows"])
    # A control: another seed moves the figures (the link's draws, the sampling), so equal bytes mean something.
    mine = next(r for r in result["rows"] if r["profile"] == "3g" and r["mode"] == "per-token")
    other = json.loads(_experiment_seed(tmp_path / "other", 4))["rows"][0]
    assert (other["profile"], other["mode"]) == ("3g", "per-token") and other["wall_s"] != mine["wall_s"]


def _experiment_seed(out: Path, seed: int) -> bytes:
    cmd = [sys.executable, "-m", "netsim", "experiment", "--clock", "virtual", "--synthetic", "--profiles", "3g",
           "--modes", "per-token", "--workloads", "chat", "--max-tokens", "16", "--seed", str(seed), "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    return (out / "results.json").read_bytes()


def test_the_in_process_channel_carries_statuses_and_streams_as_grpc_does():
    # The servicer's refusal reaches the edge as the AioRpcError a real channel raises (Verifier.call
    # reads its code and details); a Generate stream arrives token by token.
    import grpc

    from hybridspec.virtual import make_verifier
    from netsim.virtual.channel import InProcessChannel
    from spec_core.proto import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
    costs = synthetic_table(draft_row_s=0.001, pass_base_s=0.010)
    profile = Profile("t", Link((Delay(5),)), Link((Delay(5),)))

    async def main():
        verifier = make_verifier(["--backend", "synthetic", "--synthetic-vocab", "64", "--admit-ttft-ms", "0"], costs)
        try:
            stub = pb_grpc.VerifierStub(InProcessChannel(verifier.server, profile, costs))
            try:
                await stub.Verify(pb.VerifyRequest(session_id="nobody", round=1, committed_length=3,
                                                   draft_token_ids=[5]), timeout=10)
            except grpc.aio.AioRpcError as e:
                refused = (e.code(), e.details())
            t0, ids = clock.now(), []
            async for chunk in stub.Generate(pb.GenerateRequest(prompt_token_ids=[0, 5, 9], sampling=pb.SamplingParams(
                    temperature=0.7, top_p=0.95, max_new_tokens=4, ignore_eos=True, seed=1)), timeout=10):
                ids += list(chunk.token_ids)
            return refused, ids, clock.now() - t0
        finally:
            verifier.close()
    (code, details), ids, seconds = vloop.run(main)
    assert code == grpc.StatusCode.NOT_FOUND and "nobody" in details
    assert len(ids) == 4 and seconds == pytest.approx(0.010 + 4 * 0.010, abs=1e-9)   # the round trip, four passes


def test_a_sweep_cell_gives_tokens_per_second_per_mode_and_the_same_twice():
    from netsim.virtual.sweep import Cell, expected_alpha, noise_for_alpha, run_cell
    assert expected_alpha(noise_for_alpha(0.4)) == pytest.approx(0.4, abs=0.01)
    assert noise_for_alpha(0.9) < noise_for_alpha(0.4)          # a better draft is a less noisy one
    cell = Cell(rtt_ms=300, draft_ms=5, pass_ms=40, slope=0.0, alpha=0.9, tokens=16)
    one, two = run_cell(cell, modes=("per-token", "hybrid")), run_cell(cell, modes=("per-token", "hybrid"))
    assert one.tokens_per_s == two.tokens_per_s and set(one.tokens_per_s) == {"per-token", "hybrid-g4"}
    # At α 0.9 on a 300 ms link, four drafts a round trip beat one (the grid's premise, checked once).
    assert one.best == "hybrid-g4"



def test_a_virtual_verifier_keeps_no_kv_store(tiny_models, tmp_path):
    """The serve default puts a KV store on /dev/shm, shared by every verifier at the default port:
    virtual runs restored each other's checkpoints (a prompt's prefill then cost nothing, or not,
    by what ran before and when a thread wrote). A virtual verifier has none; one asked for is refused."""
    from hybridspec.virtual import make_verifier
    costs = shipped_tables()["flat-gpu"]
    model = ["--model", str(tiny_models["target"]), "--n-ctx", "256"]

    async def build():
        verifier = make_verifier(model, costs)   # the default port: the wall clock's default would pick a store
        try:
            return verifier.backend.checkpoints
        finally:
            verifier.close()
    assert vloop.run(build) is None

    async def asked():
        make_verifier([*model, "--kv-store", str(tmp_path)], costs)
    with pytest.raises(ValueError, match="without a KV store"):
        vloop.run(asked)
