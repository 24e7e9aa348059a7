"""`CloudOnlyGeneration`, what EdgeClient.generate_cloud_only returns: the verifier's own sampling of a
prompt (its Generate stream: the target alone, one token a step, nothing drafted here), as text
pieces and stats. `edge-client generate --cloud-only` runs it.

With `--coupling gumbel` and a seed it is the reference a hybrid generation equals token for token
(spec_core.gumbel); without a seed one is drawn here and reported in the stats, as for a hybrid
generation, so the two can be compared. The prompt goes the way a hybrid generation's goes
(edge_client.pairing.plan_prompt: target ids, or a text open when the draft has another
tokenizer), so both runs start from the same target ids.
"""
from __future__ import annotations

import codecs
from typing import AsyncIterator

import grpc

from edge_client.pairing import plan_prompt
from edge_client.session import Generation
from edge_client.transport import EdgeError, sampling_proto
from spec_core import clock
from spec_core.proto import verifier_pb2 as pb


class CloudOnlyGeneration(Generation):
    """Async iterator of text pieces as the verifier streams them; `stats` is complete at the end
    (rounds 0, nothing drafted; seed and coupling as sent). `aclose()` ends the stream."""

    async def _run(self) -> AsyncIterator[str]:
        client, st = self._client, self.stats
        await self._negotiate()
        pairing = await client.pairing_for(st)
        plan = await plan_prompt(pairing, self._prompt, client.run_drafting)
        req = pb.GenerateRequest(prompt_token_ids=plan.ids, sampling=sampling_proto(self.settings))
        if plan.text_open is not None:
            req.prompt_text = plan.text_open.prompt_text
            req.prompt_messages.extend(plan.text_open.prompt_messages)
        if plan.ids:
            self.prompt_ids = list(plan.ids)
        verifier = client.verifier
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pieces: list[str] = []
        t0 = clock.now()
        st.bytes_up = req.ByteSize()
        try:
            async for chunk in verifier.stub.Generate(req, timeout=max(verifier.transport.deadline_s, 600.0),
                                                      metadata=verifier.metadata):
                st.bytes_down += chunk.ByteSize()
                if chunk.prompt_token_ids:
                    self.prompt_ids = list(chunk.prompt_token_ids)
                new = list(chunk.token_ids)
                if new and not st.ttft_s:
                    st.ttft_s = clock.now() - t0
                st.token_ids.extend(new)
                st.tokens += len(new)
                st.server_model_s += chunk.model_ms / 1e3
                done = chunk.finish_reason != pb.NOT_FINISHED
                if done:
                    st.finish_reason = pb.FinishReason.Name(chunk.finish_reason).lower()
                piece = decoder.decode(b"".join(pairing.tokenizer.token_bytes(t) for t in new
                                                if t not in pairing.hidden_ids), final=done)
                if piece:
                    pieces.append(piece)
                    yield piece
        except grpc.aio.AioRpcError as e:
            raise EdgeError(e.code(), e.details() or "") from None
        finally:
            st.wall_s = clock.now() - t0
            st.tokens_per_s = st.tokens / st.wall_s if st.wall_s else 0.0
            st.text = "".join(pieces)
