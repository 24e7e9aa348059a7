"""What runs inside vLLM's engine process for sessions that keep their KV across rounds.

vLLM 0.32's streaming-input sessions (`AsyncLLM.generate` fed `StreamingInput` chunks) keep a
request's KV between chunks but only append. A round needs the opposite at its start: drop the
rejected drafts (and the sample the engine drew after them) and keep the committed tokens' KV.
Two hooks, named by string in the engine arguments (vllm_sessions.ENGINE_ARGS), do it without
changing vLLM's source:

  RollbackScheduler        (`scheduler_cls`) before a session's next chunk is appended, cuts the
                           session back to the length its sampling params carry in
                           `extra_args[KEEP_ARG]`: token lists, computed tokens, block hashes, and
                           the KV blocks after the cut (freed). A full block the prefix cache
                           already holds, with the cut inside it, is taken out of the cache when
                           this session alone holds it (its KV is about to be overwritten, so its
                           hash would hand wrong KV to a later request); when another request
                           holds it too, the session recomputes from that block's start instead.
  SessionWorkerExtension   (`worker_extension_cls`) a resumed chunk is handed to the model runner
                           as a known request (`_update_streaming_request`), which in 0.32 does not
                           register its prompt logprobs, so they came back empty; `install` (run
                           once through `collective_rpc`) wraps that method to register them as a
                           new request's are, and hands back only the last `extra_args[ROWS_ARG]`
                           prompt-logprob rows of a request that names them (vLLM's tensor spans
                           the whole prompt, and the frontend turns all of it into Python objects),
                           computing `extra_args[WIDTH_ARG]` entries a row where a request names it.
                           A chunk that names its round's rows (`extra_args[ACCEPT_ARG]`,
                           vllm_sessions.accept_spec) gets no rows at all: its logits stay here
                           (accept_step), and each engine step runs torch_accept.accept_pass once
                           over every round that step completes; the kept path and the corrected
                           or bonus token alone go back, as a [k, 1] prompt-logprob tensor.

Single KV-cache-group models only (every model the backend serves today): the scheduler refuses
to start otherwise, with the reason.
"""
from __future__ import annotations

import logging

import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import PrefillStats
from vllm.v1.outputs import LogprobsTensors

from cloud_verifier.backends.torch_accept import PassRound, accept_pass
from cloud_verifier.backends.vllm_sessions import ACCEPT_ARG, spec_round

log = logging.getLogger(__name__)

KEEP_ARG = "hybridspec_keep"   # SamplingParams.extra_args key: tokens of the session to keep
ROWS_ARG = "hybridspec_rows"   # ... the prompt-logprob rows to hand back: the last ones only
WIDTH_ARG = "hybridspec_width"  # ... the prompt-logprob entries a row to compute, in place of prompt_logprobs


class RollbackScheduler(Scheduler):
    """vLLM's scheduler with sessions that can be cut back before a chunk is appended."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"session rollback supports models with one KV-cache group; this one has {len(groups)} "
                             "(hybrid attention): run the backend with sessions off")
        self.rollbacks = 0           # chunks that cut a session back
        self.recomputed_blocks = 0   # ... whose cut block was shared, so it was recomputed from its start

    def _update_request_as_session(self, session, update) -> None:
        params = update.sampling_params if update is not None else None
        keep = (params.extra_args or {}).get(KEEP_ARG) if params is not None else None
        if keep is not None:
            lost = self._roll_back(session, int(keep))
            if lost:   # tokens kept but no longer computed (a shared cut block): computed again
                update.prompt_token_ids = lost + list(update.prompt_token_ids or ())
        super()._update_request_as_session(session, update)
        # vLLM 0.32 sets a request's PrefillStats only at its first scheduling, so its counters
        # (vllm:prompt_tokens, vllm:iteration_tokens_total) would count nothing a resumed chunk
        # computes; this chunk's prefill is the tokens after the kept ones, none from the cache.
        session.prefill_stats = PrefillStats()
        session.prefill_stats.set(num_prompt_tokens=session.num_tokens - session.num_computed_tokens,
                                  num_local_cached_tokens=0, num_external_cached_tokens=0)

    def _roll_back(self, session, keep: int) -> list[int]:
        """Cut `session` back to its first `keep` tokens; returns the tokens in [computed, keep) that
        must be appended again (their KV is gone), usually none."""
        keep = max(0, min(keep, session.num_tokens))
        computed = min(keep, session.num_computed_tokens)   # a preempted session computed less
        manager, = self.kv_cache_manager.coordinator.single_type_managers
        bs = manager.block_size
        req_id = session.request_id
        blocks = manager.req_to_blocks.get(req_id, [])
        cut = computed // bs     # the block that holds the first token to be written again
        if computed % bs and cut < len(blocks) and blocks[cut].block_hash is not None:
            if blocks[cut].ref_cnt == 1:
                manager.block_pool.evict_blocks({blocks[cut].block_id})
            else:   # another request reads this cached block: leave it whole, recompute its tokens
                computed = cut * bs
                self.recomputed_blocks += 1
        first_free = -(-computed // bs)
        if first_free < len(blocks):
            freed = blocks[first_free:]
            del blocks[first_free:]
            manager.block_pool.free_blocks(reversed(freed))   # the last block first: least likely reused
        if req_id in manager.num_cached_block:
            manager.num_cached_block[req_id] = min(manager.num_cached_block[req_id], computed // bs)
        lost = list(session._all_token_ids[computed:keep])
        del session._all_token_ids[computed:]
        del session.prompt_token_ids[computed:]
        session._output_token_ids.clear()
        session.num_prompt_tokens = len(session.prompt_token_ids)
        session.num_computed_tokens = computed
        self.rollbacks += 1
        return lost


class SessionWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); `hybridspec_install` runs once after start."""

    def hybridspec_install(self) -> int:
        """Wraps the model runner (once); returns its number of KV-cache groups (rollback needs 1),
        0 for a model runner without streaming sessions (vLLM's V2 runner)."""
        runner = self.model_runner
        if not hasattr(runner, "_update_streaming_request"):
            return 0
        if not getattr(runner, "_hybridspec_installed", False):
            resume, execute = runner._update_streaming_request, runner.execute_model
            prompt_logprobs = runner._get_prompt_logprobs_dict

            def update_streaming_request(req_id, new_req_data):
                state = resume(req_id, new_req_data)
                params = new_req_data.sampling_params
                state.in_progress_prompt_logprobs_cpu = None
                if params is not None and params.prompt_logprobs is not None:
                    runner.num_prompt_logprobs[req_id] = (runner.input_batch.vocab_size if params.prompt_logprobs == -1
                                                          else params.prompt_logprobs)
                return state

            def execute_model(scheduler_output, *args, **kwargs):
                runner._hybridspec_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
                return execute(scheduler_output, *args, **kwargs)

            def get_prompt_logprobs_dict(hidden_states, num_scheduled_tokens):
                # vLLM hands back a [prompt tokens - 1, k + 1] tensor per request, the rows before the
                # chunk unset, and the frontend turns all of it into Python objects: a request that
                # names its rows gets those alone (copied out of the whole-prompt tensor); one that
                # names its round's rows, the round's verdict (accept_step).
                accepting = {}
                for req_id in list(runner.num_prompt_logprobs):
                    state = runner.requests.get(req_id)
                    spec = ((state.sampling_params.extra_args or {}).get(ACCEPT_ARG)
                            if state is not None and state.sampling_params is not None else None)
                    if spec is not None:
                        accepting[req_id] = (spec, runner.num_prompt_logprobs.pop(req_id))
                        continue
                    width = ((state.sampling_params.extra_args or {}).get(WIDTH_ARG)
                             if state is not None and state.sampling_params is not None else None)
                    if width is not None:
                        runner.num_prompt_logprobs[req_id] = width
                out = prompt_logprobs(hidden_states, num_scheduled_tokens)
                for req_id, t in out.items():
                    state = runner.requests.get(req_id)
                    params = state.sampling_params if state is not None else None
                    rows = (params.extra_args or {}).get(ROWS_ARG) if params is not None else None
                    if t is not None and rows:
                        n = t.logprobs.shape[0]
                        out[req_id] = t._replace(logprob_token_ids=t.logprob_token_ids[n - rows:].clone(),
                                                 logprobs=t.logprobs[n - rows:].clone(),
                                                 selected_token_ranks=t.selected_token_ranks[n - rows:].clone())
                if accepting:
                    out.update(accept_step(runner, hidden_states, num_scheduled_tokens, accepting))
                return out

            runner._update_streaming_request = update_streaming_request
            runner._get_prompt_logprobs_dict = get_prompt_logprobs_dict
            runner.execute_model = execute_model
            runner._hybridspec_scheduled_tokens = 0
            runner._hybridspec_rows = {}    # req_id -> {round row: logits [vocab]} of a round not yet complete
            runner._hybridspec_passes = 0   # accept_pass calls (one per engine step with rounds to decide)
            runner._hybridspec_installed = True
        return len(runner.kv_cache_config.kv_cache_groups)

    def hybridspec_accept_passes(self) -> int:
        """accept_pass calls so far (one per engine step that completed rounds: accept_step)."""
        return getattr(self.model_runner, "_hybridspec_passes", 0)

    def hybridspec_scheduled_tokens(self) -> int:
        """Tokens the model ran so far (the sum of vLLM's `total_num_scheduled_tokens` per step)."""
        return getattr(self.model_runner, "_hybridspec_scheduled_tokens", 0)


def accept_step(runner, hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int],
                accepting: dict[str, tuple[dict, int]]) -> dict[str, LogprobsTensors]:
    """The rounds an engine step completes, decided where the logits are.

    `accepting`: req_id -> (its chunk's vllm_sessions.accept_spec, its prompt-logprob width). A chunk's
    last len(spec["rows"]) prompt positions give its round's rows spec["rows"] (the last one is the
    position vLLM samples after: a chain's bonus row); one `compute_logits` over every such position
    of the step gives them. A round's rows may come from several chunks (a tree: a chunk per leaf) and a
    chunk may span steps (chunked prefill): rows wait in runner._hybridspec_rows until the chunk that
    carries the round (spec["round"]) is complete; then one `accept_pass` over every round completed in
    this step decides them all. Each such request gets back a [len(path) + 1, 1] tensor of ids: the
    kept path (node indices), then the corrected or bonus token."""
    stash = runner._hybridspec_rows
    for req_id in [r for r in stash if r not in runner.requests]:   # ended mid-round (aborted)
        del stash[req_id]
    positions, owners, complete = [], [], []   # hidden-state rows; (req_id, round row) of each; done chunks
    for req_id, (spec, width) in accepting.items():
        n = num_scheduled_tokens.get(req_id)
        state = runner.requests[req_id]
        total = len(state.prompt_token_ids)
        if n is None:   # preempted: the chunk comes again
            runner.num_prompt_logprobs[req_id] = width
            continue
        start = state.num_computed_tokens
        offset = int(runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]])
        first = total - len(spec["rows"])   # the prompt position of spec["rows"][0]
        for pos in range(max(start, first), start + n):
            positions.append(offset + pos - start)
            owners.append((req_id, spec["rows"][pos - first]))
        if start + n >= total:
            complete.append(req_id)
        else:   # more of the chunk in a later step
            runner.num_prompt_logprobs[req_id] = width
    if positions:
        logits = runner.model.compute_logits(hidden_states[torch.as_tensor(positions, device=hidden_states.device)])
        if logits is None:   # a tensor-parallel rank other than the driver: its answer is not read
            return {}
        for k, (req_id, row) in enumerate(owners):
            stash.setdefault(req_id, {})[row] = logits[k]
    pieces, rounds, req_ids = [], [], []
    first_row = 0
    for req_id in complete:
        spec = accepting[req_id][0]
        if "round" not in spec:   # a tree's earlier leaf: its rows wait for the last one
            continue
        tree, qs, settings, uniforms, position = spec_round(spec["round"])
        rows = stash.pop(req_id)
        pieces.append(torch.stack([rows[i] for i in range(len(tree) + 1)]))
        rounds.append(PassRound(first_row, tree, qs, settings, uniforms, position))
        req_ids.append(req_id)
        first_row += len(tree) + 1
    if not rounds:
        return {}
    runner._hybridspec_passes += 1
    out = {}
    for req_id, result in zip(req_ids, accept_pass(torch.cat(pieces), rounds)):
        ids = torch.tensor(list(result.path) + [result.next_token], dtype=torch.int64)[:, None]   # [k, 1]
        out[req_id] = LogprobsTensors(ids, torch.zeros(ids.shape, dtype=torch.float32),
                                      torch.zeros(len(ids), dtype=torch.int64))
    return out
