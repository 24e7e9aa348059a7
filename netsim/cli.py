"""The `netsim` command: `netsim proxy`, `netsim profiles`, `netsim experiment`, `netsim load`,
`netsim calibrate`, `netsim sweep`.

Each subcommand is one `_add_<name>_command(subparsers)` function that registers its parser
and sets `run` to the function that carries it out; `build_parser` lists them. The
experiment runner adds its own the same way (`experiment`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from .profiles import PROFILES, Profile, get_profile
from .proxy import LinkProxy

log = logging.getLogger("netsim")


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


# --- netsim proxy -----------------------------------------------------------------------

async def _serve(args: argparse.Namespace) -> None:
    proxy = LinkProxy(listen=args.listen, upstream=args.upstream, profile=get_profile(args.profile),
                      seed=args.seed)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with proxy:
        host, port = proxy.address
        log.info("listening on %s:%d (forwarding to %s:%d); Ctrl-C to stop", host, port, *args.upstream)
        while not stop.is_set():
            try:
                async with asyncio.timeout(args.stats_every_s):
                    await stop.wait()
            except asyncio.TimeoutError:
                s = proxy.stats
                log.info("connections %d (%d open), up %d B, down %d B, chunks %d, stalls %d (%.2f s), resets %d",
                         s.connections, s.active, s.bytes_up, s.bytes_down, s.chunks, s.stalls, s.stall_s, s.resets)
        log.info("stopping: delivering what is in flight")


def _run_proxy(args: argparse.Namespace) -> int:
    asyncio.run(_serve(args))
    return 0


def _add_proxy_command(subparsers) -> None:
    parser = subparsers.add_parser("proxy", help="run the link-emulating TCP proxy",
                                   description="Forward TCP from --listen to --upstream through a profile's links.")
    parser.add_argument("--profile", required=True, choices=sorted(PROFILES), help="link profile (see `netsim profiles`)")
    parser.add_argument("--listen", type=_host_port, default=("127.0.0.1", 0), metavar="HOST:PORT",
                        help="address to listen on (default 127.0.0.1:0, a free port)")
    parser.add_argument("--upstream", type=_host_port, required=True, metavar="HOST:PORT",
                        help="address to forward to")
    parser.add_argument("--seed", type=int, default=0, help="seed for every random draw (default 0)")
    parser.add_argument("--stats-every-s", type=float, default=10.0, help="seconds between stats log lines")
    parser.set_defaults(run=_run_proxy)


# --- netsim profiles --------------------------------------------------------------------

def _rate_text(rate_kbit_s: float | None) -> str:
    if rate_kbit_s is None:
        return "-"
    return f"{rate_kbit_s / 1000:.4g} Mbit/s" if rate_kbit_s >= 1000 else f"{rate_kbit_s:.4g} kbit/s"


def _extras_text(profile: Profile) -> str:
    kinds = {effect.kind for link in (profile.uplink, profile.downlink) for effect in link.effects}
    return ", ".join(sorted(kinds & {"jitter", "outage", "trace", "handover", "ge-loss"})) or "-"


def _run_profiles(args: argparse.Namespace) -> int:
    if args.json:
        json.dump([profile.to_dict() for profile in PROFILES.values()], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="netsim profiles (RTT = mean of both one-way delays, without queueing)")
    for column in ("name", "RTT ms", "up", "down", "loss up/down", "also"):
        table.add_column(column, no_wrap=True)
    table.add_column("source", overflow="fold")
    for profile in PROFILES.values():
        table.add_row(
            profile.name, f"{profile.rtt_ms():g}", _rate_text(profile.uplink.rate_kbit_s()),
            _rate_text(profile.downlink.rate_kbit_s()),
            f"{profile.uplink.mean_loss_rate():.2%} / {profile.downlink.mean_loss_rate():.2%}",
            _extras_text(profile), profile.source)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)   # piped or captured: don't crop to the 80-column default
    console.print(table)
    return 0


def _add_profiles_command(subparsers) -> None:
    parser = subparsers.add_parser("profiles", help="list the link profiles and their sources")
    parser.add_argument("--json", action="store_true", help="print every profile's full settings as JSON")
    parser.set_defaults(run=_run_profiles)


# --- experiment -------------------------------------------------------------------------

def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _run_experiment(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from .experiment import ALL_MODES, TEMPERATURE, ExperimentConfig, run_experiment
    from .report import write_all

    modes = list(ALL_MODES) if args.modes == "all" else _csv(args.modes)
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(ALL_MODES)} or 'all'")
    models = _models(args)
    cfg = ExperimentConfig(
        profiles=_csv(args.profiles), modes=modes, out=Path(args.out),
        workloads=list(TEMPERATURE) if args.workloads == "all" else _csv(args.workloads),
        prompts_per_workload=args.prompts_per_workload, max_tokens=args.max_tokens,
        gammas=[int(g) for g in _csv(args.gammas)], target=models.target, draft=models.draft, pair=models.pair,
        qmode=args.q,
        seed=args.seed, coupling=args.coupling, synthetic=args.synthetic, crossover=not args.no_crossover,
        crossover_rtts_ms=[float(x) for x in _csv(args.crossover_rtts)],
        crossover_steps_ms=[float(x) for x in _csv(args.crossover_steps)])
    for name in cfg.profiles:
        get_profile(name)  # fail before a long run, with the list of names
    if args.clock == "virtual":
        return _run_virtual(cfg, args.costs, args.workers)
    if args.costs:
        raise SystemExit("netsim: --costs is for --clock virtual (the wall clock measures its own costs)")
    return _run_and_report(run_experiment, write_all, cfg, label_width=48)


def _run_virtual(cfg, costs_name: str | None, workers: int = 1) -> int:
    """The experiment on the virtual clock (netsim.virtual.experiment): the shipped edge loop and
    engine in this process, time from the cost table, results byte for byte the same on any machine."""
    from hybridspec.virtual import make_verifier
    from .report import write_all
    from .virtual.costs import default_table, load_table
    from .virtual.experiment import run_virtual_experiment

    try:
        costs = load_table(costs_name) if costs_name else default_table(cfg)
    except ValueError as e:
        raise SystemExit(f"netsim: {e}") from None
    return _run_virtual_and_report(lambda progress: run_virtual_experiment(cfg, costs, make_verifier, progress,
                                                                   workers=workers), write_all, cfg.out, costs.name, 48)


def _run_virtual_and_report(run, write_all, out, table: str, label_width: int) -> int:
    """A virtual-clock run under a progress bar: its files, and run.json beside them (where and when it
    ran, which its results leave out); prints its report."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hybridspec.machine import describe as describe_machine
    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S"), time.perf_counter()
    with Progress(TextColumn(f"{{task.description:<{label_width}}}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as progress:
        result = run(progress)
    paths = write_all(result, out)
    run_info = {"clock": "virtual", "cost_table": table, "started": started, "real_s": time.perf_counter() - t0,
                "machine": describe_machine(), "command": " ".join(sys.argv)}
    paths["run"] = out / "run.json"
    paths["run"].write_text(json.dumps(run_info, indent=1) + "\n")
    print(paths["report"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _models(args: argparse.Namespace):
    """--pair, or --target / --draft (paths or bundled names), as paths; a clear exit otherwise."""
    from .pairs import resolve
    if getattr(args, "synthetic", False):
        return resolve(None, None, None)
    try:
        models = resolve(args.pair, args.target, args.draft)
        from llama_runtime import find_model
        for path in (models.target, models.draft):
            if path:
                find_model(path)    # there and readable, before a long run starts (ModelMissing says how)
        return models
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise SystemExit(f"netsim: {e.args[0] if isinstance(e, KeyError) else e}") from None


def _add_model_options(parser: argparse.ArgumentParser, target_help: str) -> None:
    from .pairs import PAIRS
    parser.add_argument("--pair", choices=list(PAIRS),
                        help="a named model pair: " + "; ".join(f"{p.name} = {p.description}" for p in PAIRS.values())
                             + " (default: smollm2, or --target/--draft)")
    parser.add_argument("--target", help=target_help + "; a path or a bundled model's name (smollm2, gemma)")
    parser.add_argument("--draft", help="draft GGUF, or a bundled model's name (smollm2, gemma) (default: "
                                        "models/smollm2-draft.gguf); a draft of another tokenizer drafts across "
                                        "vocabularies")


def _run_and_report(run, write_all, cfg, label_width: int) -> int:
    """Run an experiment or load test under a progress bar, write its files, print its report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn(f"{{task.description:<{label_width}}}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as progress:
        result = asyncio.run(run(cfg, progress))
    paths = write_all(result, cfg.out)
    print(paths["report"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _add_coupling(parser) -> None:
    parser.add_argument("--coupling", choices=("rejection", "gumbel"), default="rejection",
                        help="how drafts are checked (edge-client generate --help): gumbel makes every mode commit "
                             "the same ids per prompt and seed (the target's own sampling), so mode comparisons "
                             "carry no output variance; rejection (default) accepts more")


def _add_experiment_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "experiment", help="run every mode over link profiles and workloads, write results and a report",
        description="Start a verifier, put each profile's link between it and the edge, and measure "
                    "edge-only, cloud-only, cloud-stepwise (γ = 0), per-token, hybrid (fixed γ), adaptive γ, "
                    "token trees, proactive drafting, pipelined rounds, continuations and a window of rounds in flight "
                    "on each workload.")
    parser.add_argument("--profiles", default="lan,lte,3g,edge-lossy,geo-sat", help="comma-separated profile names")
    parser.add_argument("--modes", default="all", help="all, or a comma-separated subset of " + ", ".join(
        ("edge-only", "cloud-only", "cloud-stepwise", "per-token", "hybrid", "adaptive", "tree", "proactive",
         "pipeline", "continuations", "window", "fused", "auto")) + " (hybrid, tree, proactive, pipeline, continuations, "
        "window and fused run once per γ in --gammas; auto is the default edge: the planner picks each round's shape)")
    parser.add_argument("--workloads", default="all",
                        help="all, or a subset of code,json,summarisation,translation,chat,creative")
    parser.add_argument("--prompts-per-workload", type=int, default=1, help="prompts run from each workload")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens generated per run")
    parser.add_argument("--gammas", default="4", help="fixed γ values for the hybrid mode, e.g. 2,4,8")
    parser.add_argument("--q", default="fixed:16:16", help="q on the wire (see edge-client generate --help)")
    _add_model_options(parser, "target GGUF (default: bundled SmolLM2)")
    parser.add_argument("--synthetic", action="store_true", help="use the synthetic model pair (fast sweeps)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the sampling and of every link's random draws")
    _add_coupling(parser)
    parser.add_argument("--no-crossover", action="store_true", help="skip the synthetic RTT x cloud-step grid")
    parser.add_argument("--crossover-rtts", default="5,50,150,300,600", help="link RTTs in ms for the grid")
    parser.add_argument("--crossover-steps", default="5,20,60,150", help="cloud step times in ms for the grid")
    parser.add_argument("--clock", choices=["wall", "virtual"], default="wall",
                        help="wall: a verifier process and the link proxy, timed on this machine; virtual: the same "
                             "edge loop and engine in this process, every cost from --costs and the links drawn from "
                             "the seed (the same results on any machine: docs/netsim.md#two-clocks)")
    parser.add_argument("--costs", metavar="TABLE",
                        help="(--clock virtual) cost table: a file from `netsim calibrate`, or a shipped one: "
                             + ", ".join(_shipped_names()) + " (default: the pair's own table; the synthetic pair: "
                             "its --synthetic-* costs)")
    parser.add_argument("--workers", type=int, default=1,
                        help="(--clock virtual) worker processes, a profile each at a time (the results do not change)")
    parser.add_argument("--out", default="results", help="output folder")
    parser.set_defaults(run=_run_experiment)


def _shipped_names() -> list[str]:
    from .virtual.costs import shipped_tables
    return sorted(shipped_tables())


# --- load -------------------------------------------------------------------------------

def _run_load(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from .load import MODES, LoadConfig, run_load, write_all

    modes = list(MODES) if args.mode == "all" else _csv(args.mode)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODES)} or 'all'")
    profiles = _csv(args.profile)
    for name in profiles:
        get_profile(name)
    models = _models(args)
    if args.workers is not None and not args.locust and args.clock != "virtual":
        raise SystemExit("netsim load: --workers needs --locust or --clock virtual (the in-process run has one "
                         "event loop)")
    cfg = LoadConfig(edges=[int(n) for n in _csv(args.edges)], profiles=profiles, modes=modes,
                     duration_s=args.duration, out=Path(args.out), synthetic=args.synthetic, server=args.server,
                     metrics_url=args.metrics_url, verifier_args=args.verifier_arg, gamma=args.gamma,
                     max_tokens=args.max_tokens, arrival_rate=args.arrival_rate, seed=args.seed,
                     draft_ms=args.draft_ms, synthetic_step_ms=args.synthetic_step_ms, target=models.target,
                     draft=models.draft, pair=models.pair, drafter=args.drafter, warmup_s=args.warmup,
                     slo_tpot_ms=LoadConfig.slo_tpot_ms if args.slo_tpot_ms is None else args.slo_tpot_ms,
                     slo_ttft_ms=LoadConfig.slo_ttft_ms if args.slo_ttft_ms is None else args.slo_ttft_ms,
                     coupling=args.coupling)
    if args.clock == "virtual":
        return _run_virtual_load(args, cfg)
    if args.costs:
        raise SystemExit("netsim load: --costs is for --clock virtual (the wall clock measures its own costs)")
    if args.locust_csv:
        from .load.locustrun import read_locust_runs
        cfg.out.mkdir(parents=True, exist_ok=True)
        try:
            result = read_locust_runs(args.locust_csv, cfg, {"slo_tpot_ms": args.slo_tpot_ms,
                                                              "slo_ttft_ms": args.slo_ttft_ms})
        except ValueError as e:
            raise SystemExit(f"netsim load --locust-csv: {e}") from None
        paths = write_all(result, cfg.out)
        print(paths["report"].read_text())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    if args.locust:
        import os

        from .load.locustrun import run_locust_load
        workers = args.workers or os.cpu_count() or 1
        return _run_and_report(lambda c, p: run_locust_load(c, workers, p), write_all, cfg, label_width=40)
    return _run_and_report(run_load, write_all, cfg, label_width=32)


def _run_virtual_load(args: argparse.Namespace, cfg) -> int:
    """The load test on the virtual clock (netsim.virtual.load): the same edges and the shipped
    verifier in this process, time from the cost table; no machine's speed or load in the figures."""
    from hybridspec.virtual import make_verifier
    from .load import write_all
    from .virtual.load import check, load_table, run_virtual_load

    harness = [flag for flag, given in (("--locust", args.locust), ("--locust-csv", args.locust_csv)) if given]
    if harness:
        raise SystemExit(f"netsim load: --clock virtual runs every edge on one virtual event loop in this process; "
                         f"{', '.join(harness)} runs them as Locust users on the wall clock")
    try:
        check(cfg)
        costs = load_table(cfg, args.costs)
    except ValueError as e:
        raise SystemExit(f"netsim load: {e}") from None
    return _run_virtual_and_report(lambda progress: run_virtual_load(cfg, costs, make_verifier, progress,
                                                             workers=args.workers or 1), write_all, cfg.out, costs.name, 32)


def _add_load_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "load", help="N edges, each through its own link, against one verifier: throughput, latency, cost",
        description="Run N edges (each its own gRPC channel through its own netsim link) against one verifier "
                    "for a fixed time, per mode, and report committed tokens/s, time per output token, TTFT, "
                    "target cost per token, errors, and the verifier's CPU and memory.")
    parser.add_argument("--edges", default="4", help="number of edges; a comma-separated list runs each (e.g. 1,4,16)")
    parser.add_argument("--profile", default="lan", help="link profile, or a comma-separated mix (edge i gets the "
                                                         "i-th, cycling)")
    parser.add_argument("--mode", default="hybrid,cloud-only", help="all, or a comma-separated subset of "
                                                                    "hybrid, adaptive, cloud-only, auto (the "
                                                                    "default edge: the planner's shapes)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before the measured window")
    parser.add_argument("--synthetic", action="store_true", help="the synthetic pair (fast; for large N)")
    parser.add_argument("--server", help="HOST:PORT of a running verifier (default: start one)")
    parser.add_argument("--metrics-url", help="with --server: its Prometheus endpoint, e.g. http://HOST:9100/metrics")
    parser.add_argument("--verifier-arg", action="append", default=[], metavar="ARG",
                        help="option for the `cloud-verifier serve` that netsim starts (repeatable), e.g. "
                             "--verifier-arg=--batching --verifier-arg=on")
    parser.add_argument("--gamma", type=int, default=4, help="fixed γ of the hybrid mode")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--arrival-rate", type=float, default=0.0,
                        help="requests/s per edge as a Poisson process (default 0: back to back, fixed concurrency)")
    parser.add_argument("--draft-ms", type=float, default=2.0,
                        help="synthetic or lookup drafter: the device's cost per drafted token (ms), emulated")
    parser.add_argument("--synthetic-step-ms", type=float, default=20.0,
                        help="synthetic verifier netsim starts: cost per forward pass (ms)")
    _add_model_options(parser, "target GGUF for the verifier netsim starts (default: bundled SmolLM2)")
    parser.add_argument("--drafter", choices=["gguf", "lookup"], default="gguf",
                        help="real target: gguf = a draft model per edge, run on this machine's CPU (a few edges); "
                             "lookup = prompt lookup, no model, --draft-ms emulated per token (many edges)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the sampling, the arrivals and the links")
    _add_coupling(parser)
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help="SLO on time per output token: goodput counts requests within it, capacity is the most "
                             "edges whose p95 is (default 150; with --locust-csv: the runs' own)")
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="SLO on time to first token, for requests that arrive in the window (default 2000; with "
                             "--locust-csv: the runs' own)")
    parser.add_argument("--locust", action="store_true",
                        help="run the edges as Locust users (netsim/load/locustfile.py) on a master and --workers "
                             "local worker processes; the merged statistics make the same report")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="with --locust: worker processes on this machine (default: one per core); with "
                             "--clock virtual: runs at a time, a process each (default 1; the figures do not change)")
    parser.add_argument("--clock", choices=["wall", "virtual"], default="wall",
                        help="wall: a verifier process and a link proxy per edge, timed on this machine; virtual: the "
                             "same edges and the shipped verifier in this process, every cost from --costs and the "
                             "links drawn from the seed (the same figures on any machine: docs/many-edges.md)")
    parser.add_argument("--costs", metavar="TABLE",
                        help="(--clock virtual) cost table: a file from `netsim calibrate`, or a shipped one: "
                             + ", ".join(_shipped_names()) + " (default: the pair's own table; the synthetic pair: "
                             "a pass of --synthetic-step-ms)")
    parser.add_argument("--locust-csv", action="append", default=[], metavar="PREFIX",
                        help="make the report from Locust runs already made (each run's --csv PREFIX, with the "
                             "locustfile's PREFIX_netsim.json beside it; repeatable): no run is started")
    parser.add_argument("--out", default="results/load", help="output folder (load.json, load.md, plots)")
    parser.set_defaults(run=_run_load)


# --- fleet ------------------------------------------------------------------------------

def _run_fleet(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .fleet import fleet_markdown, fleet_plot, run_fleet
    from .fleet.gpu import gpu_cases

    profiles = _csv(args.profile)
    for name in profiles:
        get_profile(name)
    load_results = [json.loads(Path(path).read_text()) for path in args.calibrate]
    cpu_cost = None
    if args.cpu_cost_ms:
        from .fleet import LinearCost
        fixed_ms, per_token_ms = (float(x) for x in args.cpu_cost_ms.split(","))
        cpu_cost = LinearCost(fixed_ms / 1000.0, per_token_ms / 1000.0, name="given")
    result = run_fleet(load_results, slo_s=args.slo_ms / 1000.0, totals=[int(float(t)) for t in _csv(args.totals)],
                       profiles=profiles, cpu_per_token_s=args.cpu_per_token_ms / 1000.0, gpu=args.gpu,
                       gpu_alpha=args.gpu_alpha, gpu_draft_s=args.gpu_draft_ms / 1000.0, gpu_context=args.gpu_context,
                       gpu_overhead_s=args.gpu_overhead_ms / 1000.0, cpu_cost=cpu_cost, cpu_ubatch=args.cpu_ubatch,
                       slo_ttft_s=args.slo_ttft_ms / 1000.0, gpu_duration_s=args.gpu_duration,
                       gpu_max_tokens=args.gpu_max_tokens, gpu_prompt_tokens=args.gpu_prompt_tokens,
                       gpu_cases=gpu_cases(args.gpu_block_size) if args.gpu_table == "on" else None,
                       specedge=dict(tokens_per_round=[3.0, 3.5, 4.0], batches=[2, 4, 8, 16]) if args.specedge else None,
                       progress=lambda name: log.info("%s", name))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.json").write_text(json.dumps(result, indent=1))
    (out / "fleet.md").write_text(fleet_markdown(result))
    fleet_plot(result, out / "verifiers_vs_edges.png")
    if args.result and result.get("gpu_capacity"):
        from hybridspec.figures import write_result

        from .fleet.gpu import gpu_registry
        figures, tables = gpu_registry(result)
        print(f"wrote {write_result(args.result, figures=figures, tables=tables, note='a model: its figures do not depend on the machine', clock='model')}")
    print((out / "fleet.md").read_text())
    print(f"wrote {out / 'fleet.json'}, {out / 'fleet.md'}, {out / 'verifiers_vs_edges.png'}")
    return 0


def _add_fleet_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "fleet", help="simulate edges sharing verifiers, calibrated on a `netsim load` run; verifiers per N edges",
        description="Calibrate a discrete-event model on a load result (serial or batching verifier, as it ran), "
                    "check it against that result, then find "
                    "how many verifiers serve 10^3..10^6 edges at a p95 time-per-output-token SLO, hybrid vs "
                    "cloud-only, for the measured CPU backend (serial and batched) and a GPU roofline.")
    parser.add_argument("--calibrate", required=True, action="append", metavar="LOAD_JSON",
                        help="load.json from `netsim load` (repeatable: each is checked; the capacity table's serial "
                             "rows use the first serial run's calibration, its batched rows the first batched one's)")
    parser.add_argument("--slo-tpot-ms", "--slo-ms", dest="slo_ms", type=float, default=150.0,
                        help="SLO: p95 time per output token (ms), as netsim load's --slo-tpot-ms")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0,
                        help="SLO: p95 time to first token (ms), as netsim load's --slo-ttft-ms")
    parser.add_argument("--totals", default="1e3,1e4,1e5,1e6", help="fleet sizes (edges)")
    parser.add_argument("--profile", default="lte", help="link profile(s) of the fleet's edges, comma-separated mix")
    parser.add_argument("--cpu-per-token-ms", type=float, default=0.0,
                        help="CPU pass cost per token (ms); the fixed part is calibrated (0: the synthetic target)")
    parser.add_argument("--cpu-cost-ms", metavar="FIXED,PER_TOKEN",
                        help="CPU pass cost for the capacity table instead of the calibrated one, e.g. 15.9,7.15 "
                             "(bench/verify_cost.py: llama.cpp SmolLM2, context 512)")
    parser.add_argument("--cpu-ubatch", type=int,
                        help="tokens per batched pass of the CPU backend in the capacity table (default: the "
                             "calibrated verifier's, 512 for the synthetic target; 32 for batched llama.cpp)")
    parser.add_argument("--gpu", choices=["h200", "h100"], default="h200",
                        help="the GPU of the modelled case (roofline of Llama-3.1-8B bf16 on it)")
    parser.add_argument("--gpu-alpha", type=float, default=0.7, help="per-token acceptance of the GPU case's pair")
    parser.add_argument("--gpu-draft-ms", type=float, default=10.0, help="device drafting time per token (ms)")
    parser.add_argument("--gpu-context", type=int, default=1024, help="mean context per session (tokens)")
    parser.add_argument("--gpu-max-tokens", type=int, default=256,
                        help="tokens generated per request in the GPU table (the regime map's workload)")
    parser.add_argument("--gpu-prompt-tokens", type=int, default=128,
                        help="new prompt tokens per request in the GPU table (the regime map's workload)")
    parser.add_argument("--gpu-overhead-ms", type=float, default=0.05,
                        help="server CPU per round on the GPU verifier (ms; one at a time; streams stay in the batch)")
    parser.add_argument("--gpu-table", choices=["on", "off"], default="on",
                        help="capacity and goodput at the SLO per GPU for each verification path of the vLLM "
                             "backend, with and without KV offload and the draft budget (the headline)")
    parser.add_argument("--gpu-block-size", type=int, default=16, help="vLLM's KV block size on the GPU (tokens)")
    parser.add_argument("--gpu-duration", type=float, default=6.0, help="simulated seconds per GPU-table point")
    parser.add_argument("--specedge", action="store_true",
                        help="also SpecEdge's published set-up (Qwen3-14B on an A100, RTX 4090 edges, 14 ms RTT)")
    parser.add_argument("--out", default="results/fleet", help="output folder")
    parser.add_argument("--result", default="",
                        help="also write the GPU table to bench/results/RESULT.json (the figures registry)")
    parser.set_defaults(run=_run_fleet)


# --- entry point ------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="netsim", description="User-space link emulation for TCP (gRPC) traffic.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG (every stall and reset)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_proxy_command(subparsers)
    _add_profiles_command(subparsers)
    _add_experiment_command(subparsers)
    _add_load_command(subparsers)
    _add_fleet_command(subparsers)
    from .virtual.cli import add_calibrate_command, add_sweep_command
    add_calibrate_command(subparsers, _add_model_options, _models)
    add_sweep_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The experiment draws a progress bar: per-connection INFO lines would scroll it away.
    quiet = logging.WARNING if args.command in ("experiment", "load", "calibrate", "sweep") else logging.INFO
    logging.basicConfig(level=logging.DEBUG if args.verbose else quiet,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)
