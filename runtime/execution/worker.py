# SPDX-License-Identifier: Apache-2.0
"""Workers sit between the scheduler (requests, token ids) and the model runners (tensors).

A step gets prefill chunks (`req`, `end`: process `all_ids[num_cached:end]`) and decode
requests (one uncached token each) and returns a `TokenOutput` per request: the new
tokens (none for a prefill chunk that does not reach the end of its prompt) and, when the
request asked for them, their logprobs. The scheduler applies the finish checks.

`PlainWorker` runs everything in one forward: decode rows and prefill chunks mix freely.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.constrained import bitmask as grammar_bitmask
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.core.step_io import Chunk, TokenOutput
from runtime.execution.model_runner import ModelInput, ModelRunner
from runtime.execution.penalties import RowHistory, adjust_logits
from runtime.execution.sampler import SamplingBatch, sample


def chunk_input(
    chunks: Sequence[Chunk], mode: ForwardMode, capture: CaptureHiddenMode = CaptureHiddenMode.NULL
) -> ModelInput:
    ids = [t for c in chunks for t in c.req.all_ids[c.start : c.end]]
    return ModelInput(
        mode,
        torch.tensor(ids, dtype=torch.long),
        req_pool_indices=[c.req.req_pool_idx for c in chunks],
        prefix_lens=[c.start for c in chunks],
        extend_lens=[c.length for c in chunks],
        capture_hidden_mode=capture,
    )


def wants_prompt_logprobs(req) -> bool:
    return req.return_logprob and req.logprob_start_len >= 0 and not req.input_logprobs_done


def prompt_logprob_rows(chunk: Chunk) -> list[int]:
    """Positions (within the prompt) whose row scores a prompt token the request wants the
    logprob of: the row at position p scores token p + 1."""
    if not wants_prompt_logprobs(chunk.req):
        return []
    last = len(chunk.req.prompt_ids) - 2  # the row before the last prompt token
    first = max(chunk.req.logprob_start_len, 1) - 1
    return list(range(max(first, chunk.start), min(last, chunk.end - 1) + 1))


class LogitRows:
    """Which logits rows a step computes: every chunk's last row plus prompt-logprob rows."""

    def __init__(self, chunks: Sequence[Chunk]):
        self.rows: list[int] = []
        self.last: list[int] = []
        self.prompt: list[list[tuple[int, int]]] = []  # per chunk: (position, index into rows)
        offset = 0
        for c in chunks:
            wanted = []
            for pos in prompt_logprob_rows(c):
                wanted.append((pos, len(self.rows)))
                self.rows.append(offset + pos - c.start)
            self.prompt.append(wanted)
            self.last.append(len(self.rows))
            self.rows.append(offset + c.length - 1)
            offset += c.length


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def top_logprob_lists(req, rows: torch.Tensor) -> list[list[tuple[float, int]]] | None:
    """The request's `top_logprobs_num` best (logprob, id) of each log-softmaxed row."""
    if req.top_logprobs_num <= 0:
        return None
    values, ids = rows.topk(req.top_logprobs_num, dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]


def token_ids_logprob_lists(req, rows: torch.Tensor) -> list[list[tuple[float, int]]] | None:
    """(logprob, id) of each of the request's `token_ids_logprob` in each log-softmaxed row."""
    wanted = req.token_ids_logprob
    if wanted is None:
        return None
    return [list(zip(values, wanted)) for values in rows[:, wanted].tolist()]


def _new_token_rows(logprobs: torch.Tensor, b: int, tokens, row_offsets) -> torch.Tensor:
    return logprobs[row_offsets[b] : row_offsets[b] + len(tokens[b])]


def token_logprob_outputs(
    reqs: Sequence, logits: torch.Tensor, tokens: list[list[int]], row_offsets: list[int]
) -> list[tuple[list[float], list | None] | None]:
    """Logprobs of each request's new tokens; `logits` rows `row_offsets[b] + i` score
    token i of request b. None for requests that did not ask."""
    out = []
    logprobs = None
    for b, req in enumerate(reqs):
        if not req.return_logprob or not tokens[b]:
            out.append(None)
            continue
        if logprobs is None:
            logprobs = log_softmax_rows(logits)
        rows = _new_token_rows(logprobs, b, tokens, row_offsets)
        new_ids = torch.tensor(tokens[b], device=rows.device).unsqueeze(1)
        values = rows.gather(1, new_ids).squeeze(1).tolist()
        out.append((values, top_logprob_lists(req, rows)))
    return out


def token_ids_logprob_outputs(
    reqs: Sequence, logits: torch.Tensor, tokens: list[list[int]], row_offsets: list[int]
) -> list[list[list[tuple[float, int]]] | None]:
    """Per request, the `token_ids_logprob` lists of its new tokens (rows as in
    `token_logprob_outputs`); None for requests that did not ask."""
    out = []
    logprobs = None
    for b, req in enumerate(reqs):
        if not req.return_logprob or req.token_ids_logprob is None or not tokens[b]:
            out.append(None)
            continue
        if logprobs is None:
            logprobs = log_softmax_rows(logits)
        out.append(token_ids_logprob_lists(req, _new_token_rows(logprobs, b, tokens, row_offsets)))
    return out


def sample_rows(
    reqs: Sequence,
    logits: torch.Tensor,
    extra: Sequence[tuple[int, ...]] | None,
    vocab_size: int,
    eos_ids: set[int],
    generator: torch.Generator | None,
    bitmask: torch.Tensor | None = None,
) -> list[int]:
    """One token per row (`reqs[i]` owns row i, with tentative `extra[i]` tokens appended);
    `bitmask` (see `runtime.constrained.bitmask`) restricts rows with a grammar."""
    extra = extra or [()] * len(reqs)
    adjusted = adjust_logits(logits, [RowHistory(r, e) for r, e in zip(reqs, extra)], eos_ids)
    logits = grammar_bitmask.apply(adjusted, bitmask, unadjusted=logits)
    # sampling runs where the logits are; only the chosen ids come back to the host
    batch = SamplingBatch.from_params([r.sampling_params for r in reqs], vocab_size, logits.device)
    positions = torch.tensor(
        [r.seq_len + len(e) for r, e in zip(reqs, extra)], dtype=torch.long, device=logits.device
    )
    return sample(logits, batch, positions, generator).tolist()


class PlainWorker:
    """A `Worker` (`runtime.core.worker`) without speculation."""

    supports_mixed = True
    speculation = None  # no draft: see `NextNWorker.speculation`

    def __init__(
        self, target: ModelRunner, eos_ids: set[int], generator: torch.Generator | None = None
    ):
        self.target, self.eos_ids, self.generator = target, eos_ids, generator
        self.vocab_size = target.model_config.vocab_size

    def reserve_ahead(self) -> int:
        """Positions past `seq_len` a step may write (none: decode writes `seq_len - 1`)."""
        return 0

    def release(self, reqs: Sequence, keep_state: bool = False) -> list[None]:
        """`reqs` leave the running batch (finished, retracted or aborted): nothing is kept
        for them here, and no drafts come back."""
        return [None] * len(reqs)

    def owed_draft_rows(self, req) -> None:
        """Rows a draft has not run over for `req` (none: there is no draft)."""
        return None

    def step(
        self, prefill: Sequence[Chunk], decode: Sequence
    ) -> tuple[list[TokenOutput], list[TokenOutput]]:
        decoding = [Chunk(r, r.seq_len - 1, r.seq_len) for r in decode]
        chunks = list(prefill) + decoding
        rows = LogitRows(chunks)
        bitmask = sampling_bitmask(chunks, self.vocab_size)  # host work before the forward
        decode_inp = target_input(decoding, ForwardMode.DECODE) if prefill and decoding else None
        if decode_inp is not None and self.target.captures(decode_inp):
            # A mixed step whose decode rows have a captured decode step: they replay it and
            # only the prompt chunks run eagerly (in the ragged forward, each decode row
            # would take a query tile and key window of its own). The logits come out in
            # the one-forward layout (every chunk's rows in order), so sampling is the same.
            prefill_inp = target_input(list(prefill), ForwardMode.EXTEND)
            logits = torch.cat([self._logits(prefill_inp), self._logits(decode_inp)])
        else:
            all_single = all(c.length == 1 for c in chunks) and not prefill
            mode = ForwardMode.DECODE if all_single else ForwardMode.EXTEND
            logits = self._logits(target_input(chunks, mode))
        outputs = chunk_outputs(
            chunks, rows, logits, self.vocab_size, self.eos_ids, self.generator, bitmask
        )
        return outputs[: len(prefill)], outputs[len(prefill) :]

    def _logits(self, inp: ModelInput) -> torch.Tensor:
        return self.target.forward(inp).next_token_logits


def target_input(chunks: list[Chunk], mode: ForwardMode) -> ModelInput:
    """The target forward's input over `chunks`, with logits at their `LogitRows` rows."""
    inp = chunk_input(chunks, mode)
    inp.logits_row_indices = LogitRows(chunks).rows
    return inp


def sampling_bitmask(chunks: Sequence[Chunk], vocab_size: int) -> torch.Tensor | None:
    """Grammar bitmask of the rows `chunk_outputs` samples (the completing chunks', in
    order); None when none of them has a grammar."""
    grammars = [c.req.grammar for c in chunks if c.completes]
    return grammar_bitmask.next_token_bitmask(grammars, vocab_size)


def chunk_outputs(
    chunks: Sequence[Chunk],
    rows: LogitRows,
    logits: torch.Tensor,
    vocab_size: int,
    eos_ids: set[int],
    generator: torch.Generator | None,
    bitmask: torch.Tensor | None = None,
) -> list[TokenOutput]:
    """Sample the next token of every chunk that reaches its request's end (under its
    grammar's row of `bitmask`, from `sampling_bitmask`); logprobs where asked (new tokens
    and prompt tokens)."""
    outputs = [TokenOutput() for _ in chunks]
    sampling = [i for i, c in enumerate(chunks) if c.completes]
    if sampling:
        last = logits[[rows.last[i] for i in sampling]]
        reqs = [chunks[i].req for i in sampling]
        tokens = sample_rows(reqs, last, None, vocab_size, eos_ids, generator, bitmask)
        new = [[t] for t in tokens]
        lp = token_logprob_outputs(reqs, last, new, list(range(len(reqs))))
        ids_lp = token_ids_logprob_outputs(reqs, last, new, list(range(len(reqs))))
        for i, token, logprob, ids_logprob in zip(sampling, tokens, lp, ids_lp):
            outputs[i].tokens = [token]
            if logprob is not None:
                outputs[i].logprobs, outputs[i].top_logprobs = logprob
            outputs[i].token_ids_logprobs = ids_logprob
    attach_prompt_logprobs(chunks, rows, logits, outputs)
    return outputs


def attach_prompt_logprobs(
    chunks: Sequence[Chunk], rows: LogitRows, logits: torch.Tensor, outputs: list[TokenOutput]
) -> None:
    """Prompt-token logprobs of the chunks that asked, from the rows this prefill already
    computed (row p scores token p + 1; the prompt's first token gets None), with their
    top and `token_ids_logprob` lists when asked."""
    for chunk, wanted, out in zip(chunks, rows.prompt, outputs):
        req = chunk.req
        if not wants_prompt_logprobs(req):
            continue
        entries: list[tuple[int, float | None]] = []
        top: list | None = [] if req.top_logprobs_num > 0 else None
        ids: list | None = [] if req.token_ids_logprob is not None else None
        if req.logprob_start_len == 0 and chunk.start == 0:
            entries.append((0, None))
            for lists in (top, ids):
                if lists is not None:
                    lists.append(None)
        if wanted:
            lp = log_softmax_rows(logits[[i for _, i in wanted]])
            targets = torch.tensor(
                [req.prompt_ids[pos + 1] for pos, _ in wanted], device=lp.device
            ).unsqueeze(1)
            entries += [
                (pos + 1, v)
                for (pos, _), v in zip(wanted, lp.gather(1, targets).squeeze(1).tolist())
            ]
            if top is not None:
                top += top_logprob_lists(req, lp)
            if ids is not None:
                ids += token_ids_logprob_lists(req, lp)
        out.input_logprobs, out.input_top_logprobs, out.input_token_ids_logprobs = (
            entries,
            top,
            ids,
        )
