"""What `--tree auto` chooses: the bundled pair on this CPU verifier (cost grows ~15-30 ms per
node) vs the synthetic pair on a flat, GPU-like verifier (20 ms + 0.05 ms per node). Prints how
many rounds each plan got (chain, a 2γ-node tree, a 4γ-node tree) and the tokens per round.

  PYTHONPATH=. python bench/tree_auto_policy.py
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from hybridspec.machine import announce

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def main() -> None:
    announce()
    from cloud_verifier.backends.llama_cpp import LlamaCppBackend
    from cloud_verifier.backends.synthetic import SyntheticBackend
    from cloud_verifier.server import VerifierServer
    from edge_client import EdgeClient
    from edge_client.drafters import DEFAULT_DRAFT, GGUFDrafter, SyntheticDrafter
    from edge_client.options import EdgeOptions, Speculation, Transport
    from edge_client.text import SyntheticTokenizer, render_chat
    from llama_runtime import bundled_model_path
    from spec_core.warping import SamplingSettings

    backend = LlamaCppBackend(str(bundled_model_path()), n_ctx=1024, n_threads=1)
    drafter = GGUFDrafter(str(DEFAULT_DRAFT), n_threads=1, n_ctx=1024, max_tree_nodes=64)
    try:
        async with VerifierServer(backend, "127.0.0.1", 0) as server:
            options = EdgeOptions(Transport(f"127.0.0.1:{server.port}"), Speculation(plan="off", gamma=4, tree="auto"))
            async with EdgeClient(options, drafter, drafter.model) as c:
                gen = c.generate(render_chat(drafter.model, "Tell me about the history of the bicycle."),
                                 SamplingSettings(temperature=0.7, top_p=0.95, max_new_tokens=96, seed=1,
                                                  ignore_eos=True))
                await gen.text()
        s = gen.stats
        print(f"bundled pair, CPU verifier: {s.plans}; tokens/round {s.tokens_per_round:.2f}, "
              f"nodes/round {s.nodes_per_round:.1f}")
    finally:
        drafter.close()
        backend.close()
    async with VerifierServer(SyntheticBackend(vocab=64, step_ms=20, per_token_ms=0.05), "127.0.0.1", 0) as server:
        options = EdgeOptions(Transport(f"127.0.0.1:{server.port}"), Speculation(plan="off", gamma=4, tree="auto"))
        async with EdgeClient(options, SyntheticDrafter(64, noise=1.0, per_token_ms=2), SyntheticTokenizer(64)) as c:
            gen = c.generate([0, 5, 6], SamplingSettings(temperature=0.0, max_new_tokens=160, ignore_eos=True))
            await gen.text()
    s = gen.stats
    print(f"synthetic pair, flat verifier (20 ms + 0.05 ms/node): {s.plans}; tokens/round "
          f"{s.tokens_per_round:.2f}, nodes/round {s.nodes_per_round:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
