"""One step's input tensors, staged through one persistent host buffer.

Every input of a step is int32 and packed from offset 0 of one host buffer (pinned on CUDA),
which reaches the device in a single copy; the tensors the model reads are views of the
device side:

    | input_ids [R] | positions [R] | slot_mapping [R] | last_rows [S] | context_lens [S] |
    | query_start_loc [S + 1] | shared_prefix [1] | logits_rows [L] | block_tables [S, width] |

each field starting at a multiple of 16 bytes (`FIELD_ALIGN`). `shared_prefix` holds the
length of the prefix every sequence shares (worker/attention/shared_prefix.py, found on the host tables
as they are written; 0 for none, and for a decode step), which cascade attention reads.

R rows (the step's tokens), S sequences, L rows whose logits the step returns when it asks for
more than each sequence's last (draft tokens to verify, prompt logprobs; L = 0 otherwise). A
padded row has token 0, position 0 and slot -1; a padded sequence has context length 0, so the
kernels skip both; a padded entry of logits_rows reads row 0, and its logits are dropped.

A decode graph of bucket b reads the views of R = S = b and width = max_blocks_per_seq, which
sit at the same addresses every step; a prefill graph of T tokens and S sequences, those of
R = T and S; a verify graph's, those of R = L = T and S. Their block-table rows are written
only as far as each table goes: entries past a context are never read.

On the CPU the host buffer is the device buffer, and grows when a step needs more room.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spillway.kernels.host_copy import copy_by_kernel
from spillway.worker.attention.shared_prefix import shared_prefix_len


@dataclass(slots=True)
class StepLayout:
    """Device views of one step's inputs (see the module docstring), all int32."""

    query_lens: list[int]
    starts: list[int]
    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    slot_mapping: torch.Tensor  # [rows], -1 for a padded row
    last_rows: torch.Tensor  # [seqs]: each sequence's last row
    context_lens: torch.Tensor  # [seqs]: cached + new tokens, 0 for a padded sequence
    query_start_loc: torch.Tensor  # [seqs + 1]
    shared_prefix: torch.Tensor  # [1]: `shared_prefix_len` below, for the kernels
    logits_rows: torch.Tensor  # [L]: the rows whose logits the step returns; empty: last_rows
    block_tables: torch.Tensor  # [seqs, width]
    host_block_tables: np.ndarray | None = None  # the same in the host buffer, until the next step is staged
    shared_prefix_len: int = 0  # tokens every sequence shares (worker/attention/shared_prefix.py)


# Every field starts 16 bytes into alignment and an unpadded step's block tables are a whole
# number of 16-entry rows wide. Triton specialises a kernel on its pointers' 16-byte alignment
# and on integer arguments that are 1 or multiples of 16: with fields packed end to end, the
# eager path met a new combination of the step's row and sequence counts every few shapes and
# compiled a kernel variant inside a request (~0.5-1 s each).
FIELD_ALIGN = 4  # int32 elements
TABLE_WIDTH_MULTIPLE = 16  # blocks


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _field_sizes(num_rows: int, num_seqs: int, num_logits_rows: int) -> tuple[int, ...]:
    return num_rows, num_rows, num_rows, num_seqs, num_seqs, num_seqs + 1, 1, num_logits_rows


def _offsets(num_rows: int, num_seqs: int, num_logits_rows: int = 0) -> tuple[int, ...]:
    """Start of each field in the packed buffer, then the start of the block tables."""
    starts = [0]
    for size in _field_sizes(num_rows, num_seqs, num_logits_rows):
        starts.append(starts[-1] + _round_up(size, FIELD_ALIGN))
    return tuple(starts)


class StepInputs:
    """The persistent staging buffer; `stage` for any batch, `stage_decode`, `stage_prefill` and
    `stage_verify` for a graph's bucket. Room for as many logits rows as tokens."""

    def __init__(
        self, *, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
        device: torch.device,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.on_cpu = device.type != "cuda"
        self.max_blocks_per_seq = max_blocks_per_seq
        self._arange = np.arange(max_num_seqs + 1)
        self._allocate(max(max_num_tokens, max_num_seqs), max_num_seqs, max_blocks_per_seq)
        # The host buffer may be rewritten only once the last copy out of it has run.
        self._copied = None if self.on_cpu else torch.cuda.Event()
        # Copy by a kernel instead of a copy engine (kernels/host_copy.py): `stage_by_kernel`.
        self.copy_by_kernel = False

    def stage_by_kernel(self) -> None:
        """From now on copy the staged inputs to the device by a kernel, not a copy engine: where
        the CPU tier's bulk copies keep the copy engines busy, a copy engine would queue these
        few kilobytes behind them."""
        self.copy_by_kernel = True

    def _allocate(self, num_tokens: int, num_seqs: int, width: int) -> None:
        self.capacity = (num_tokens, num_seqs, width)
        self.host = torch.zeros(_offsets(num_tokens, num_seqs, num_tokens)[-1] + num_seqs * width, dtype=torch.int32,
                                pin_memory=not self.on_cpu)
        self.host_np = self.host.numpy()
        self.dev = self.host if self.on_cpu else torch.zeros_like(self.host, device=self.device)

    def _reserve(self, num_rows: int, num_seqs: int, width: int) -> None:
        if num_rows <= self.capacity[0] and num_seqs <= self.capacity[1] and width <= self.capacity[2]:
            return
        if not self.on_cpu:
            raise ValueError(
                f"a step of {num_rows} tokens, {num_seqs} sequences and {width} blocks per sequence "
                f"exceeds the runner's limits {self.capacity}"
            )
        self._allocate(*(max(a, b) for a, b in zip(self.capacity, (num_rows, num_seqs, width))))

    def _host_fields(self, num_rows: int, num_seqs: int, width: int, num_logits_rows: int = 0) -> list[np.ndarray]:
        self._wait_for_last_copy()
        return self._fields(self.host_np, num_rows, num_seqs, width, num_logits_rows)

    @staticmethod
    def _fields(buffer, num_rows: int, num_seqs: int, width: int, num_logits_rows: int = 0) -> list:
        """Views of the packed fields of `buffer` (a numpy array or a tensor), in layout order."""
        offsets = _offsets(num_rows, num_seqs, num_logits_rows)
        sizes = _field_sizes(num_rows, num_seqs, num_logits_rows)
        fields = [buffer[start: start + size] for start, size in zip(offsets, sizes)]
        tables = buffer[offsets[-1]: offsets[-1] + num_seqs * width]
        return [*fields, tables.reshape(num_seqs, width)]  # contiguous: a view, never a copy

    def _wait_for_last_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def _copy(self, num_rows: int, num_seqs: int, width: int, num_logits_rows: int = 0) -> None:
        if self.on_cpu:
            return
        size = _offsets(num_rows, num_seqs, num_logits_rows)[-1] + num_seqs * width
        if self.copy_by_kernel:
            copy_by_kernel(self.dev[:size], self.host[:size])
        else:
            self.dev[:size].copy_(self.host[:size], non_blocking=True)
        self._copied.record()

    def _layout(self, query_lens, starts, num_rows: int, num_seqs: int, width: int,
                num_logits_rows: int = 0) -> StepLayout:
        host_tables = self._fields(self.host_np, num_rows, num_seqs, width, num_logits_rows)[-1]
        return StepLayout(query_lens, starts, *self._fields(self.dev, num_rows, num_seqs, width, num_logits_rows),
                          host_block_tables=host_tables)

    def stage(self, chunks, logits_rows: Sequence[int] = ()) -> StepLayout:
        """Inputs for any batch of chunks, unpadded, block tables as wide as the longest context
        rounded up to `TABLE_WIDTH_MULTIPLE` (within the runner's limit); `logits_rows`, when
        the step returns those rows' logits."""
        query_lens = [len(chunk.token_ids) for chunk in chunks]
        needed = max(-(-(chunk.start + n) // self.block_size) for chunk, n in zip(chunks, query_lens))
        width = max(needed, min(_round_up(needed, TABLE_WIDTH_MULTIPLE), self.capacity[2]))
        self._reserve(max(sum(query_lens), len(logits_rows)), len(chunks), width)
        return self._stage_rows(chunks, query_lens, sum(query_lens), len(chunks), width, clear_tables=True,
                                logits_rows=logits_rows, num_logits_rows=len(logits_rows))

    def prefill_layout(self, num_rows: int, num_seqs: int) -> StepLayout:
        """The fixed views a prefill graph of `num_rows` tokens in `num_seqs` sequences reads."""
        return self._layout([], [], num_rows, num_seqs, self.max_blocks_per_seq)

    def pad_prefill(self, num_rows: int, num_seqs: int) -> None:
        """Every row and sequence of `prefill_layout(num_rows, num_seqs)` padded: what a graph
        is captured over."""
        self._stage_rows([], [], num_rows, num_seqs, self.max_blocks_per_seq, clear_tables=False)

    def stage_prefill(self, chunks, num_rows: int, num_seqs: int) -> StepLayout:
        """Write `chunks` into `prefill_layout(num_rows, num_seqs)`, padding the rows and
        sequences past theirs; returns their (unpadded) layout's lengths over the padded views."""
        query_lens = self._check_bucket(chunks, num_rows, num_seqs)
        return self._stage_rows(chunks, query_lens, num_rows, num_seqs, self.max_blocks_per_seq, clear_tables=False)

    def verify_layout(self, num_rows: int, num_seqs: int) -> StepLayout:
        """The fixed views a verify graph of `num_rows` tokens in `num_seqs` sequences reads:
        a prefill graph's, and `num_rows` logits rows."""
        return self._layout([], [], num_rows, num_seqs, self.max_blocks_per_seq, num_rows)

    def pad_verify(self, num_rows: int, num_seqs: int) -> None:
        """Every row, sequence and logits row of `verify_layout(num_rows, num_seqs)` padded."""
        self._stage_rows([], [], num_rows, num_seqs, self.max_blocks_per_seq, clear_tables=False,
                         num_logits_rows=num_rows)

    def stage_verify(self, chunks, logits_rows: list[int], num_rows: int, num_seqs: int) -> StepLayout:
        """`stage_prefill` into `verify_layout(num_rows, num_seqs)`, with `logits_rows` first in
        its logits rows and row 0 after them."""
        query_lens = self._check_bucket(chunks, num_rows, num_seqs)
        if len(logits_rows) > num_rows:
            raise ValueError(f"{len(logits_rows)} logits rows exceed a graph of {num_rows} tokens")
        return self._stage_rows(chunks, query_lens, num_rows, num_seqs, self.max_blocks_per_seq, clear_tables=False,
                                logits_rows=logits_rows, num_logits_rows=num_rows)

    def _check_bucket(self, chunks, num_rows: int, num_seqs: int) -> list[int]:
        """The chunks' query lengths; ValueError when they do not fit a graph's bucket."""
        query_lens = [len(chunk.token_ids) for chunk in chunks]
        if sum(query_lens) > num_rows or len(chunks) > num_seqs:
            raise ValueError(f"{sum(query_lens)} tokens in {len(chunks)} sequences exceed a graph of "
                             f"{num_rows} tokens and {num_seqs} sequences")
        longest = max(len(chunk.slot_table) for chunk in chunks)
        if longest > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {longest} blocks exceeds the limit of {self.max_blocks_per_seq}")
        return query_lens

    def _stage_rows(self, chunks, query_lens: list[int], num_rows: int, num_seqs: int, width: int, *,
                    clear_tables: bool, logits_rows: Sequence[int] = (), num_logits_rows: int = 0) -> StepLayout:
        """The chunks' rows first, then padding up to `num_rows` rows and `num_seqs` sequences
        (token 0, position 0, slot -1; no new tokens, context 0, last row 0), and `logits_rows`
        then row 0 up to `num_logits_rows`. `clear_tables`: zero each block-table row past its
        context (an unpadded step's tables, which the plain-torch backend gathers whole); a
        graph's wide tables are left as they are."""
        block_size = self.block_size
        starts = [chunk.start for chunk in chunks]
        ends = [start + n for start, n in zip(starts, query_lens)]
        input_ids, positions, slots, last_rows, context_lens, query_start_loc, shared_prefix, row_index, tables = (
            self._host_fields(num_rows, num_seqs, width, num_logits_rows))
        real_rows, real_seqs = sum(query_lens), len(chunks)
        if logits_rows and not 0 <= min(logits_rows) <= max(logits_rows) < real_rows:
            raise ValueError(f"logits rows {min(logits_rows)}..{max(logits_rows)} are not rows of a step "
                             f"of {real_rows} tokens")
        row_index[:len(logits_rows)] = logits_rows
        row_index[len(logits_rows):] = 0

        input_ids[:real_rows] = list(itertools.chain.from_iterable(chunk.token_ids for chunk in chunks))
        for seq, (chunk, end) in enumerate(zip(chunks, ends)):
            count = -(-end // block_size)
            if len(chunk.slot_table) < count:
                raise ValueError(f"a block table of {len(chunk.slot_table)} blocks cannot hold {end} tokens")
            tables[seq, :count] = chunk.slot_table[:count]
            if clear_tables:
                tables[seq, count:] = 0
        lens = np.asarray(query_lens, dtype=np.int64)
        query_start_loc[0] = 0
        np.cumsum(lens, out=query_start_loc[1: real_seqs + 1])
        query_start_loc[real_seqs + 1:] = real_rows
        last_rows[:real_seqs] = query_start_loc[1: real_seqs + 1] - 1
        last_rows[real_seqs:] = 0
        context_lens[:real_seqs] = ends
        context_lens[real_seqs:] = 0
        row_positions = np.arange(real_rows) + np.repeat(np.asarray(starts, dtype=np.int64) - query_start_loc[:real_seqs], lens)
        positions[:real_rows] = row_positions
        row_blocks = tables[np.repeat(np.arange(real_seqs), lens), row_positions // block_size]
        slots[:real_rows] = row_blocks * block_size + row_positions % block_size
        input_ids[real_rows:] = 0
        positions[real_rows:] = 0
        slots[real_rows:] = -1
        shared_prefix[0] = shared_prefix_len(starts, tables, block_size)

        self._copy(num_rows, num_seqs, width, num_logits_rows)
        layout = self._layout(query_lens, starts, num_rows, num_seqs, width, num_logits_rows)
        layout.shared_prefix_len = int(shared_prefix[0])
        return layout

    def decode_layout(self, bucket: int) -> StepLayout:
        """The fixed views a decode graph of `bucket` rows reads (one new token per row)."""
        return self._layout([1] * bucket, [0] * bucket, bucket, bucket, self.max_blocks_per_seq)

    def pad_decode(self, bucket: int) -> None:
        """Every row of `bucket` padded: what a graph is captured over."""
        self._stage_decode_rows([], bucket)

    def stage_decode(self, chunks, bucket: int) -> None:
        """Write one-token chunks into `decode_layout(bucket)`, rows past len(chunks) padded."""
        longest = max(len(chunk.slot_table) for chunk in chunks)
        if longest > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {longest} blocks exceeds the limit of {self.max_blocks_per_seq}")
        self._stage_decode_rows(chunks, bucket)

    def _stage_decode_rows(self, chunks, bucket: int) -> None:
        block_size = self.block_size
        num_seqs = len(chunks)
        input_ids, positions, slots, last_rows, context_lens, query_start_loc, shared_prefix, _, tables = (
            self._host_fields(bucket, bucket, self.max_blocks_per_seq))
        for seq, chunk in enumerate(chunks):
            start = chunk.start
            table = chunk.slot_table
            if len(table) <= start // block_size:
                raise ValueError(f"a block table of {len(table)} blocks cannot hold {start + 1} tokens")
            input_ids[seq] = chunk.token_ids[0]
            positions[seq] = start
            slots[seq] = table[start // block_size] * block_size + start % block_size
            context_lens[seq] = start + 1
            tables[seq, : len(table)] = table  # entries past the context are never read
        if num_seqs < bucket:
            input_ids[num_seqs:] = 0
            positions[num_seqs:] = 0
            slots[num_seqs:] = -1
            context_lens[num_seqs:] = 0
        shared_prefix[0] = 0
        last_rows[:] = self._arange[:bucket]
        query_start_loc[:] = self._arange[: bucket + 1]
        self._copy(bucket, bucket, self.max_blocks_per_seq)
