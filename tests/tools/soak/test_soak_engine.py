"""tools/soak/engine.py: the generations it draws, the prompts it builds, the heap it reads
from smaps, and its flags; the engine run itself is a measurement (docs/performance.md)."""

from __future__ import annotations

import random
import sys
from itertools import islice
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from spillway.tools.loadgen.corpus import RANDOM_TOKEN_IDS  # noqa: E402
from spillway.tools.soak.engine import (  # noqa: E402
    CHAT_PREFIX_TOKENS, heap_resident_bytes, malloc_bytes, parse_args, prompt_ids, specs,
)
from spillway.tools.soak.traffic import ABORT_AFTER_EVENTS, OUTPUT_TOKENS  # noqa: E402

SMAPS = """\
55d0c0a00000-55d0c0a21000 r--p 00000000 08:01 1234    /usr/bin/python3.12
Size:                132 kB
Rss:                 128 kB
55d0c1a00000-55d0d2a00000 rw-p 00000000 00:00 0       [heap]
Size:             278528 kB
Rss:              204800 kB
Pss:              204800 kB
VmFlags: rd wr mr mw me ac
7f0000000000-7f0010000000 rw-p 00000000 00:00 0
Size:             262144 kB
Rss:              262144 kB
"""


def test_specs_follow_the_soak_traffic_and_its_seed():
    drawn = list(islice(specs(7), 400))
    assert drawn == list(islice(specs(7), 400))
    assert drawn != list(islice(specs(8), 400))
    assert all(OUTPUT_TOKENS[0] <= s.max_tokens <= OUTPUT_TOKENS[1] for s in drawn)
    assert all(s.temperature in (0.0, 0.8) for s in drawn)
    assert all(s.cut_after is None or 1 <= s.cut_after <= s.max_tokens for s in drawn)
    aborts = [s for s in drawn if s.cut_after is not None and s.max_tokens == OUTPUT_TOKENS[1]
              and s.cut_after <= ABORT_AFTER_EVENTS[1]]
    assert aborts and sum(s.cut_after is None for s in drawn) > len(drawn) / 2  # most run to their budget
    assert {s.chat for s in drawn} == {True, False}
    lengths = [s.prompt_tokens for s in drawn]
    assert min(lengths) < 40 and max(lengths) > 350  # 4-300 words, some behind a chat prefix


def test_chat_prompts_share_their_prefix_and_nothing_else():
    chat, completion = (next(s for s in specs(0) if s.chat is wanted) for wanted in (True, False))
    rng = random.Random(0)
    first, second, plain = prompt_ids(chat, rng), prompt_ids(chat, rng), prompt_ids(completion, rng)
    assert len(first) == len(second) == chat.prompt_tokens and len(plain) == completion.prompt_tokens
    assert first[:CHAT_PREFIX_TOKENS] == second[:CHAT_PREFIX_TOKENS]
    assert first[CHAT_PREFIX_TOKENS:] != second[CHAT_PREFIX_TOKENS:]
    assert all(RANDOM_TOKEN_IDS[0] <= token < RANDOM_TOKEN_IDS[1] for token in first + plain)


def test_heap_resident_bytes_reads_only_the_heap_mapping():
    assert heap_resident_bytes(SMAPS) == 204800 * 1024
    assert heap_resident_bytes(SMAPS.replace("[heap]", "")) == 0


def test_malloc_bytes_reads_glibc_counters():
    counters = malloc_bytes()
    if counters is not None:  # glibc 2.33+
        in_use, held = counters
        assert in_use > 0 and held >= 0


@pytest.mark.parametrize("flag", ["--requests", "--concurrency", "--every"])
def test_counts_below_one_exit_2_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([flag, "0"])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
