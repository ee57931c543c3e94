"""LLMEngine: a Llama-family model served with continuous batching by the simulator's own Scheduler.

Every step: the shared `Scheduler` decides what runs (admitting, preempting by recompute or swap, allocating
through the shared `BlockManager`, `GroupedBlockManager` or `ContiguousAllocator`); the engine performs the
swap, copy-on-write and KV-tier moves it returned, packs every scheduled prefill chunk and decode token into
one forward (no padding), samples, and appends and finishes through the scheduler in `simulator.simulate`'s
order, so a replay makes a simulation's decisions. While every running request is a plain decode, the step
takes the scheduler's decode batch (decode_step.py): the same decisions in O(what changes).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from gpu_backend.cache_engine import CacheEngine
from gpu_backend.engine.beam_search import beam_step
from gpu_backend.engine.block_table_store import BlockTableStore
from gpu_backend.engine.cuda_graph import DecodeGraphRunner, decode_graphs_apply
from gpu_backend.engine.decode_step import DecodeStepper
from gpu_backend.engine.engine_config import EngineConfig
from gpu_backend.engine.group_tables import GroupInputs
from gpu_backend.engine.input_batch import SequenceInput, build_model_input
from gpu_backend.engine.kv_groups import blocks_needed, grouped_pool, layer_slots
from gpu_backend.engine.kv_sizing import kv_capacity_tokens, make_allocator
from gpu_backend.engine.kv_tier_setup import build_tier_data
from gpu_backend.engine.model_setup import engine_model
from gpu_backend.engine.params import EngineInputError, RequestOutput, SamplingParams
from gpu_backend.engine.requests import RequestState, check_prompt
from gpu_backend.engine.sampling import SamplingBatch, compute_logprobs, greedy_tokens, make_generator, sample
from gpu_backend.engine.step import StepResult, is_shared, plan_step, resolve_rows, start_prefills
from gpu_backend.model import CausalLM
from simulator.core.contiguous.placement import next_pow2
from simulator.core.paged.block_manager import BlockManager
from simulator.core.scheduler import Scheduler
from simulator.core.sequence import Sequence, SequenceGroup, SequenceStatus


class LLMEngine:
    """Continuous-batching inference over a paged (or contiguous) KV cache managed by the shared core.

    `decode_batch=False` takes every step through `Scheduler.schedule()`: the reference whose decisions
    the decode batch's steps make too (tests/gpu_backend/test_decode_step.py).
    """

    def __init__(self, model: str | Path | CausalLM = "tiny", device: str | torch.device = "auto",
                 backend: str = "auto", block_size: int = 16, num_blocks: int | None = None,
                 kv_memory_gb: float | None = None, dtype: str | torch.dtype | None = None,
                 enable_prefix_caching: bool = True, allocator: str = "paged", *, seed: int = 0,
                 record_events: bool = False, clock: Callable[[], float] | None = None,
                 track_memory: bool = False, decode_batch: bool = True, **options):
        try:
            config = EngineConfig(block_size=block_size, num_blocks=num_blocks, kv_memory_gb=kv_memory_gb,
                                  enable_prefix_caching=enable_prefix_caching, allocator=allocator, seed=seed,
                                  **options)
        except TypeError as exc:
            raise EngineInputError(f"unknown engine option: {exc}") from None
        self.config = config
        self.model = engine_model(model, device, dtype, backend, seed)
        self.device = self.model.device
        self.max_model_len = config.max_model_len or self.model.config.max_model_len
        self.bytes_per_token = self.model.config.kv_bytes_per_token(self.model.dtype)
        sched_config = config.scheduler_config(self.max_model_len)
        self.capacity_tokens, self.capacity_source = kv_capacity_tokens(config, self.model, sched_config)
        # Several KV cache groups (engine/kv_groups.py): None for one group of full-attention layers.
        self.kv_groups = grouped_pool(config, self.model, self.capacity_tokens, sched_config)
        grouped = self.kv_groups is not None
        self.allocator = make_allocator(config, self.capacity_tokens, self.bytes_per_token,
                                        self.max_model_len, record_events, self.kv_groups)
        self.output_len: dict[int, int] = {}  # request id -> max_tokens, for the decode batch
        decode_batch = decode_batch and not grouped  # the decode batch keeps one table per sequence
        self.scheduler = Scheduler(sched_config, self.allocator, self.output_len if decode_batch else None)
        paged = grouped or isinstance(self.allocator, BlockManager)
        self.cache = CacheEngine(
            self.model, contiguous=not paged, block_size=config.block_size,
            num_blocks=self.allocator.num_blocks if paged else self.capacity_tokens,
            num_cpu_blocks=self.allocator.num_cpu_blocks if paged else self.allocator.cpu_capacity_tokens,
            layer_slots=layer_slots(self.allocator.layout) if grouped else None)
        self.cache.tiers = build_tier_data(config, self.allocator, self.cache.device_cache,
                                           self.bytes_per_token)
        # Paged: tables persist across steps (appended to); contiguous: none; grouped: each group's, per step.
        self.group_inputs = GroupInputs(self.allocator, self.device) if grouped else None
        self.tables = None if self.cache.contiguous or grouped else BlockTableStore(
            -(-self.max_model_len // config.block_size) + 1, rows=max(16, config.max_num_seqs))
        self.eos = set(self.model.config.eos_token_ids)
        self.track_memory = track_memory
        self.decoder = DecodeStepper(self) if decode_batch else None
        self.graph_runner = None
        backend = getattr(self.model.attn_backend, "name", "")
        if decode_graphs_apply(self.device.type, backend, config.enforce_eager):
            self.graph_runner = DecodeGraphRunner(
                self._forward, config.max_num_seqs, -(-self.max_model_len // config.block_size) + 1,
                self.max_model_len, self.cache.contiguous, self.device,
                buffers=None if self.decoder is None else self.decoder.buffers,
                layer_group=self.group_inputs.layer_group if grouped else None)
        # With a clock, the allocation log's `now` is set when the step is scheduled and when its forward
        # is done, so allocations and releases carry the times the simulator would give them.
        self.clock = clock
        self.generator = make_generator(seed, self.device)
        self._requests: dict[int, RequestState] = {}
        self._pending_logits: dict[int, torch.Tensor] = {}
        self._next_request_id = 0
        self._next_seq_id = 0

    # ----------------------------------------------------------------- requests
    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def add_request(self, prompt_token_ids, params: SamplingParams, request_id: int | None = None,
                    arrival_s: float = 0.0, check: bool = True) -> int:
        """Queue one request; return its id. With `check`, refuse up front what could never run."""
        rid = self._next_request_id if request_id is None else int(request_id)
        if rid in self._requests:
            raise EngineInputError(f"request id {rid} is already in use")
        prompt = check_prompt(prompt_token_ids, self.model.config.vocab_size, f"request {rid}")
        if check:
            self._check_fits(rid, len(prompt), params)
        self._next_request_id = max(self._next_request_id, rid + 1)
        state = RequestState.create(rid, prompt, params, [self._new_seq_id() for _ in range(params.width)],
                                    arrival_s)
        self._requests[rid] = state
        if params.width == 1 and not params.use_beam_search:
            self.output_len[rid] = params.max_tokens
        self.scheduler.add_request(state.group)
        return rid

    def _check_fits(self, rid: int, prompt_len: int, params: SamplingParams) -> None:
        """A request longer than max_model_len, or larger than the whole pool, would never finish."""
        final_len = prompt_len + params.max_tokens - 1
        if final_len > self.max_model_len:
            raise EngineInputError(f"request {rid}: {prompt_len} prompt tokens + max_tokens "
                                   f"{params.max_tokens} need {final_len} positions, more than "
                                   f"max_model_len {self.max_model_len}")
        bs, width = self.config.block_size, params.width
        if self.kv_groups is None and not isinstance(self.allocator, BlockManager):
            # Contiguous: the allocator's own answer, as buddy placement rounds a region up to a power of 2.
            group = SequenceGroup(rid, [Sequence(i, prompt_len, final_len) for i in range(width)])
            if not self.allocator.can_ever_allocate(group):
                region = self.allocator.reservation(group.seqs[0])
                rounded = f" ({next_pow2(region)} once buddy placement rounds it up)" \
                    if self.allocator.placement_name == "buddy" and next_pow2(region) > region else ""
                raise EngineInputError(f"request {rid} needs {width} KV region(s) of {region} slots"
                                       f"{rounded}, which the pool of {self.capacity_tokens} slots can never "
                                       "hold at once")
            return
        # Sequences re-admitted after a recompute hold all their tokens each (only the prefix cache may find
        # their common prompt): a full copy each, so that no admitted request is rejected later.
        need = width * -(-final_len // bs) if self.kv_groups is None else \
            blocks_needed(self.allocator, prompt_len, final_len, width)
        have = self.allocator.num_blocks - self.allocator.watermark_blocks
        if need > have:
            raise EngineInputError(f"request {rid} needs up to {need} KV blocks but the pool has {have}")

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or swapped."""
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- one step
    def step(self) -> StepResult:
        """Schedule, move KV, run one packed forward, sample, and finish what is done."""
        sched = self.scheduler
        self._stamp()
        if self.decoder is not None and sched.decode_ready():
            result = self.decoder.step()
            if result is not None:
                return result
        out = sched.schedule()
        self.cache.settle_tiers()
        counts = (len(sched.running), len(sched.waiting), len(sched.swapped))
        head = sched.waiting[0] if sched.waiting else None
        result = StepResult(out, counts, self.allocator.breakdown(head) if self.track_memory else None)
        for group in out.rejected:
            result.finished.append(self._requests.pop(group.request_id).rejected_output())
            self.output_len.pop(group.request_id, None)
        for group in out.preempted:
            for s in group.seqs:
                self._pending_logits.pop(s.seq_id, None)
        if self.tables is not None:  # these groups' blocks were freed or replaced wholesale
            for groups in (out.preempted, out.swapped_in, out.admitted, out.rejected):
                self.tables.forget(s.seq_id for g in groups for s in g.seqs)
        # A step may only move KV (a group swapped out, nothing left to compute): move it all the same.
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy(out.blocks_to_copy)
        if out.is_empty:
            return result
        start_prefills(out, sched.prefill_left)
        plan = plan_step(out, sched.prefill_left, self.cache, self._pending_logits)
        batch = self._model_input(plan.inputs)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits = self.graph_runner.run(batch)
        else:
            logits = self._forward(batch)
        if plan.slot_copies:
            self.cache.device_cache.copy_blocks(plan.slot_copies)
        for seq, num in plan.advance:
            seq.num_computed_tokens += num
        for seq_id, row in plan.keep_rows:
            self._pending_logits[seq_id] = logits[row]
        if plan.pending:
            logits = torch.cat([logits, torch.stack(plan.pending)])
        result.num_computed_tokens = int(batch.input_ids.shape[0])
        result.q_lens = [len(i.token_ids) for i in plan.inputs]
        result.context_lens = [i.start_pos + len(i.token_ids) for i in plan.inputs]
        if self.clock is not None:
            self.synchronize()
            self._stamp()
        sched.commit(out)
        self._sample(plan, logits, result)
        for group in sched.remove_finished():
            result.finished.append(self._requests.pop(group.request_id).output(self.eos))
            self.output_len.pop(group.request_id, None)
            if self.tables is not None:
                self.tables.forget(s.seq_id for s in group.seqs)
        if self.tables is not None and len(self.tables.rows) > 2 * max(len(plan.inputs), 64):
            # Beams dropped inside a live group leave rows behind; sweep them now and then.
            self.tables.retain({s.seq_id for g in sched.running for s in g.seqs})
        return result

    def _forward(self, batch) -> torch.Tensor:
        """One eager forward of a packed batch over the engine's pool."""
        return self.model(batch.input_ids, batch.positions, batch.attn_metadata, self.cache.device_cache)

    def _model_input(self, inputs):
        """The step's packed inputs; paged tables come from the persistent store."""
        bs = self.cache.block_size
        if self.group_inputs is not None:
            return self.group_inputs.model_input(inputs)
        if self.tables is None:
            return build_model_input(inputs, bs, self.device, contiguous=True)
        row = self.tables.row
        tables, lens = self.tables.gather([row(i.seq_id, i.block_table) for i in inputs])
        return build_model_input(inputs, bs, self.device, block_tables=tables, table_lens=lens)

    def _stamp(self) -> None:
        if self.clock is not None and self.allocator.events is not None:
            self.allocator.events.now = self.clock()

    def _sample(self, plan, logits: torch.Tensor, result: StepResult) -> None:
        """Sample one token per live sequence of every group that computed logits; finish what is done."""
        plain, beams = [], []
        requests, first_token, greedy = self._requests, result.first_token, True
        for sg, seqs, rows in plan.sampling:
            state = requests[sg.group.request_id]
            if state.beam is None:
                plain.append((state, seqs, resolve_rows(plan, rows)))
                greedy = greedy and state.params.temperature == 0
            else:
                beams.append((state, seqs, resolve_rows(plan, rows)))
            if state.num_sampling_steps == 0:
                first_token.append(state.request_id)
            else:
                result.later_token.append(state.request_id)
            state.num_sampling_steps += 1
        if plain:
            rows = [r for _, _, rs in plain for r in rs]
            if rows == list(range(len(rows))):  # the usual case: no index_select needed
                picked = logits[:len(rows)]
            else:
                picked = logits.index_select(0, torch.tensor(rows, dtype=torch.int64, device=logits.device))
            if greedy:  # no per-row settings to gather (the one device->host sync of the step)
                tokens = iter(greedy_tokens(picked).tolist())
            else:
                params = [(st.params, st.seeds[s.seq_id], s.num_generated)
                          for st, seqs, _ in plain for s in seqs]
                batch = SamplingBatch([p.temperature for p, _, _ in params], [p.top_p for p, _, _ in params],
                                      [p.top_k for p, _, _ in params], [seed for _, seed, _ in params],
                                      [draw for _, _, draw in params])
                tokens = iter(sample(picked, batch, self.generator).tolist())
            for state, seqs, _ in plain:
                for seq in seqs:
                    self._append(state, seq, next(tokens))
        for state, seqs, rows in beams:
            self._beam(state, seqs, compute_logprobs(logits[rows]))

    def _append(self, state: RequestState, seq, token: int) -> None:
        seq.append_token(token)
        params = state.params
        if token in self.eos and not params.ignore_eos:
            state.finish_reasons[seq.seq_id] = "stop"
            self.scheduler.finish_seq(seq)
        elif seq.num_generated >= params.max_tokens:
            self.scheduler.finish_seq(seq)

    def _beam(self, state: RequestState, seqs, logprobs: torch.Tensor) -> None:
        done = beam_step(state.group, seqs, logprobs, state.beam, shared=is_shared(seqs),
                         max_tokens=state.params.max_tokens,
                         eos=set() if state.params.ignore_eos else self.eos, allocator=self.allocator,
                         finish=self.scheduler.finish_seq, new_seq_id=self._new_seq_id,
                         on_copies=self.cache.copy)
        if done is not None:
            state.beam_result = done
            for seq in state.group.seqs:
                if seq.status is not SequenceStatus.FINISHED:
                    self.scheduler.finish_seq(seq)

    # ----------------------------------------------------------------- batch API
    def generate(self, prompt_token_ids, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompts = list(prompt_token_ids)
        if params is None:
            params = SamplingParams()
        all_params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(all_params) != len(prompts):
            raise EngineInputError(f"{len(all_params)} SamplingParams for {len(prompts)} prompts")
        first = self._next_request_id
        for i, (prompt, p) in enumerate(zip(prompts, all_params, strict=True)):  # refuse before any work
            self._check_fits(first + i, len(check_prompt(prompt, self.model.config.vocab_size,
                                                          f"prompt {i}")), p)
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, all_params, strict=True)]
        wanted, done = set(ids), {}
        while wanted - done.keys():
            for output in self.step().finished:
                if output.request_id in wanted and output.outputs and \
                        output.outputs[0].finish_reason == "rejected":
                    self.abort_all()
                    raise EngineInputError(
                        f"request {output.request_id} was rejected by the scheduler: it cannot fit in the KV "
                        f"pool ({self.capacity_tokens} slots)")
                done[output.request_id] = output
        return [done[i] for i in ids]

    def abort_all(self) -> None:
        """Drop every queued and running request, releasing its KV memory."""
        sched = self.scheduler
        if sched.decode is not None:
            sched.decode.deactivate()
            self.decoder.release()
        for group in [*sched.running, *sched.swapped, *sched.waiting]:
            for s in group.seqs:
                if s.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
                    self.allocator.free(s)
                s.status = SequenceStatus.FINISHED
        sched.running.clear()
        sched.swapped.clear()
        sched.waiting.clear()
        sched.prefill_left.clear()
        self._requests.clear()
        self.output_len.clear()
        self._pending_logits.clear()

    def warmup(self, num_tokens: int = 64) -> None:
        """Run a small prefill and a decode forward so that one-time costs (thread pools, kernel
        compilation) do not land in the first measured step. Only writes pool slots nobody holds yet."""
        if self.has_unfinished() or self.allocator.breakdown().allocated:
            raise RuntimeError("warmup() must run before any request is added")
        bs, contiguous = self.cache.block_size, self.cache.contiguous
        # The decode reads n + 1 slots: within the pool and within one max_model_len region (contiguous).
        n = max(1, min(num_tokens, self.cache.device_cache.num_slots - 1, self.max_model_len - 1))
        table = (0,) if contiguous else list(range(-(-(n + 1) // bs)))
        for step in (SequenceInput([0] * n, 0, table), SequenceInput([0], n, table)):
            batch = build_model_input([step], bs, self.device, contiguous=contiguous)
            self.model(batch.input_ids, batch.positions, batch.attn_metadata, self.cache.device_cache)
        # The same decode planned for the longest context allowed: a backend may pick other kernels for long
        # contexts (Triton: split-K and its reduce), whose first compile (~0.5 s on an H200) would otherwise
        # land in a measured eager step. Attention reads only each sequence's own context.
        meta = replace(batch.attn_metadata, max_context_len=self.max_model_len)
        self.model(batch.input_ids, batch.positions, meta, self.cache.device_cache)
        self.synchronize()

    def close(self) -> None:
        """Release what outlives the engine object: the disk tier's file."""
        if self.cache.tiers is not None:
            self.cache.tiers.close()

    def synchronize(self) -> None:
        """Wait for queued device work (for honest wall-clock step times on a GPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
