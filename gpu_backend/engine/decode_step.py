"""The engine's step while every running request is a plain decode: O(what changes), not O(running).

The shared scheduler keeps such requests in its decode batch (simulator/core/decode.py, as the
simulator's fast mode does): `decode_step` gives every sequence the slot of its newest token in O(blocks
taken) and admits waiting requests; the batch predicts which requests reach max_tokens
(`pop_finished`), and this module removes those that sample an end-of-sequence id first
(`DecodeBatch.remove`). The forward's inputs come from persistent rows (decode_rows.py) written in place
into persistent buffers and sent in one copy (input_buffers.py); greedy rows sample with one argmax, and
random ones through the vectorized sampler. Steps that admit requests pack their prefill chunks after the
decode rows, planned as the exact step plans them (step.py). A request that cannot join (beams, parallel
samples, an unfinished chunked prefill) settles the batch, and the engine's exact step takes over.

Decisions are the exact step's, made in the same order: the scheduler's appends, admissions and frees
(finished requests are freed in admission order, then the prefills' finishes). Two things differ: the
forward's row order (rows move when others leave), which only the shared generator's noise for unseeded
random sampling sees; and a decode block's publication to the prefix cache comes after the step's block
takes instead of interleaved with them, which matters only when a take evicts a cached block whose
content the same step publishes again.
"""
from __future__ import annotations

import numpy as np
import torch

from gpu_backend.engine.decode_rows import DecodeRows
from gpu_backend.engine.input_batch import build_model_input
from gpu_backend.engine.input_buffers import InputBuffers
from gpu_backend.engine.sampling import SamplingBatch, greedy_tokens, sample
from gpu_backend.engine.step import StepResult, plan_step, start_prefills


class DecodeStepper:
    """Runs the engine's steps through the scheduler's decode batch while it holds the running requests."""

    def __init__(self, engine, mirror: bool | None = None):
        self.engine = engine
        contiguous = engine.cache.contiguous
        bs = engine.cache.block_size
        width = 1 if contiguous else -(-engine.max_model_len // bs) + 1
        rows = engine.config.max_num_seqs
        self.buffers = InputBuffers(rows, width, engine.scheduler.token_budget, engine.device, mirror)
        self.rows = DecodeRows(rows, bs, contiguous, self.buffers)
        self.eos = np.array(sorted(engine.eos), dtype=np.int64)
        self.on_cpu = engine.device.type == "cpu"
        self.ones = np.ones(rows, dtype=np.int64)
        self.ones.flags.writeable = False  # shared by every decode step's StepResult.q_lens
        self.loaded = False

    def release(self) -> None:
        """The batch settled (or is dropped): every row's tokens with a slot are computed."""
        for s in self.rows.clear():
            s.num_computed_tokens = s.num_tokens
        self.loaded = False

    def step(self):
        """One step through the decode batch (call after `Scheduler.decode_ready()`); None when the batch
        settled without taking a step (the exact step decides then)."""
        e = self.engine
        sched, rows = e.scheduler, self.rows
        if not self.loaded:
            for group in sched.running:
                rows.add(group, e._requests[group.request_id])
            self.loaded = True
        out = sched.decode_step()
        if out is None:
            self.release()
            return None
        e.cache.settle_tiers()
        head = sched.waiting[0] if sched.waiting else None
        result = StepResult(out, (len(sched.running), len(sched.waiting), len(sched.swapped)),
                            e.allocator.breakdown(head) if e.track_memory else None)
        for group in out.rejected:
            result.finished.append(e._requests.pop(group.request_id).rejected_output())
            e.output_len.pop(group.request_id, None)
        if e.tables is not None and (out.admitted or out.rejected or out.swapped_in):
            for groups in (out.swapped_in, out.admitted, out.rejected):
                e.tables.forget(s.seq_id for g in groups for s in g.seqs)
        if out.blocks_to_swap_in or out.blocks_to_copy:
            e.cache.swap_in(out.blocks_to_swap_in)
            e.cache.copy(out.blocks_to_copy)
        n = rows.n
        self.buffers.begin()
        plan = None
        if out.scheduled:
            start_prefills(out, sched.prefill_left)
            plan = plan_step(out, sched.prefill_left, e.cache, e._pending_logits)
            logits, q_lens, context_lens = self._mixed_forward(plan)
        else:
            logits, context_lens = self._decode_forward()
            q_lens = self.ones[:n]
        result.num_computed_tokens = n if plan is None else int(q_lens.sum())
        result.q_lens, result.context_lens = q_lens, context_lens
        if plan is not None:
            if plan.slot_copies:
                e.cache.device_cache.copy_blocks(plan.slot_copies)
            for seq, num in plan.advance:
                seq.num_computed_tokens += num
            for seq_id, row in plan.keep_rows:
                e._pending_logits[seq_id] = logits[n + row]
        if e.clock is not None:
            e.synchronize()
            e._stamp()
        if plan is not None:
            sched.commit(out)
        self._sample_rows(logits[:n], result)
        if plan is not None:
            self._prefills_sampled(out, plan, logits[n:], result)
        return result

    # ----------------------------------------------------------------- the forward
    def _decode_forward(self) -> tuple[torch.Tensor, np.ndarray]:
        """Logits of a decode-only step (a CUDA graph when one is captured for its size)."""
        e, rows, buffers = self.engine, self.rows, self.buffers
        n = rows.n
        ids, pos, slots, ctx = buffers.decode_sections()
        longest = rows.write_inputs(ids, pos, slots, ctx)
        context_lens = ctx[:n].copy()
        runner = e.graph_runner
        size = runner.bucket(n) if runner is not None else None
        if size is not None and runner.buffers is buffers:  # the graph reads these very buffers
            buffers.send_decode(n, size)
            return runner.replay(n, longest), context_lens
        buffers.send_decode(n, n)
        step = buffers.decode_input(n, longest, rows.contiguous)
        return (e._forward(step) if size is None else runner.run(step)), context_lens

    def _mixed_forward(self, plan) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Logits of a step with prefill chunks: the decode rows first, then the chunks as planned."""
        e, rows, buffers = self.engine, self.rows, self.buffers
        n, inputs, contiguous = rows.n, plan.inputs, rows.contiguous
        num_seqs = n + len(inputs)
        spill = num_seqs > buffers.table_rows  # then this step's tables are sent whole
        if spill:
            tables = np.zeros((len(inputs), buffers.width), dtype=np.int64)
            for i, seq_input in enumerate(inputs):
                tables[i, :len(seq_input.block_table)] = seq_input.block_table
        else:  # the chunks' tables go in the rows after the decode rows
            for i, seq_input in enumerate(inputs):
                if contiguous:
                    buffers.set_cell(n + i, 0, seq_input.block_table[0])
                else:
                    buffers.set_row(n + i, seq_input.block_table)
            tables = buffers.table[n:num_seqs]
        lens = np.fromiter((len(i.block_table) for i in inputs), dtype=np.int64, count=len(inputs))
        pre = build_model_input(inputs, rows.block_size, "cpu", contiguous=contiguous,
                                block_tables=None if contiguous else tables, table_lens=lens)
        meta = pre.attn_metadata
        num_tokens = n + pre.input_ids.shape[0]
        packed = buffers.packed_sections(num_tokens, num_seqs, n + meta.logits_indices.shape[0])
        longest = rows.write_inputs(packed.input_ids, packed.positions, packed.slots, packed.context_lens)
        packed.input_ids[n:] = pre.input_ids.numpy()
        packed.positions[n:] = pre.positions.numpy()
        packed.slots[n:] = meta.slot_mapping.numpy()
        packed.context_lens[n:] = meta.context_lens.numpy()
        packed.cu_seqlens[:n + 1] = np.arange(n + 1)
        packed.cu_seqlens[n + 1:] = meta.cu_seqlens_q.numpy()[1:] + n
        packed.logits_indices[:n] = np.arange(n)
        packed.logits_indices[n:] = meta.logits_indices.numpy() + n
        q_lens = np.diff(packed.cu_seqlens)
        context_lens = packed.context_lens.copy()
        buffers.send_packed()
        device_tables = None
        if spill:  # the decode rows' tables as `write_inputs` left them, then the chunks'
            device_tables = torch.from_numpy(np.concatenate([buffers.table[:n], tables])).to(e.device)
        model_input = buffers.packed_input(max(1, meta.max_q_len), max(longest, meta.max_context_len),
                                           contiguous, device_tables)
        return e._forward(model_input), q_lens, context_lens

    # ----------------------------------------------------------------- sampling and finishing
    def _sample_rows(self, logits: torch.Tensor, result) -> None:
        """Sample every row's token; finish rows that reached max_tokens or stopped at EOS."""
        e, rows = self.engine, self.rows
        n = rows.n
        result.num_batch_tokens = n
        if rows.random:
            batch = SamplingBatch(rows.temp[:n], rows.top_p[:n], rows.top_k[:n], rows.seed[:n], rows.draw[:n])
            picked = sample(logits, batch, e.generator)
            tokens = picked.numpy() if self.on_cpu else picked.cpu().numpy()
        else:
            tokens = greedy_tokens(logits)
        stopped = rows.stopped(tokens, self.eos)
        rows.advance(tokens)
        sched = e.scheduler
        done = sched.decode.pop_finished()
        if not done and not len(stopped):
            return
        requests = e._requests
        if len(stopped):
            early = []
            popped = set(done)
            for r in stopped.tolist():
                group = rows.groups[r]
                requests[group.request_id].finish_reasons[group.seqs[0].seq_id] = "stop"
                if group not in popped:
                    early.append(group)
            if early:
                sched.decode.remove(early)
                done = done + early
        row_of, rank = rows.row_of, rows.rank
        done.sort(key=lambda g: rank[row_of[g.seqs[0].seq_id]])
        sched.finish_groups(done)
        self._finished(done, result)
        rows.remove([row_of[g.seqs[0].seq_id] for g in done])

    def _finished(self, groups, result) -> None:
        """Outputs of finished requests; their state leaves the engine."""
        e = self.engine
        for g in groups:
            result.finished.append(e._requests.pop(g.request_id).output(e.eos))
            e.output_len.pop(g.request_id, None)
            if e.tables is not None:
                e.tables.forget(s.seq_id for s in g.seqs)

    def _prefills_sampled(self, out, plan, logits: torch.Tensor, result) -> None:
        """Sample the chunks that completed a prefill (the exact step's sampler), finish what is done and
        let the rest join the batch (or settle it when one cannot)."""
        e = self.engine
        sched = e.scheduler
        if plan.pending:
            logits = torch.cat([logits, torch.stack(plan.pending)])
        e._sample(plan, logits, result)
        finished = [sg.group for sg in out.scheduled if sg.group.is_finished]
        if finished:
            sched.finish_groups(finished)
            self._finished(finished, result)
        joining = [sg.group for sg in out.scheduled if not sg.group.is_finished]
        if not joining:
            return
        batch = sched.decode
        batch.join(joining)
        if not batch.active:
            self.release()
            return
        for group in joining:
            self.rows.add(group, e._requests[group.request_id])
