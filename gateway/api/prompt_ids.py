"""A prompt's token ids on their way to the wire: checked and packed in as few passes as the
event loop can afford.

A 10,000-id prompt costs the event loop ~0.2 ms to decode from JSON; every further pass over
it as Python ints costs another 0.04-0.09 ms (a type check, a copy, a range check, a pack).
So a token-id prompt is packed once (`pack_token_ids`: little-endian uint32, what `Generate`
carries and the block hashes are computed from), the pack being its type check too, and its
range is read from the packed bytes by numpy.

Once checked, a prompt keeps its ids as an array of uint32, not as the decoded list: the list's
int objects (~0.4 MB for 10k ids) are freed at intake instead of living as long as the request.
Fifty long prompts at once otherwise hold ~20 MB of them, each request's decode filling fresh
memory (page faults, cache misses) where it could reuse what the one before it freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from spillway.gateway.api.openai import bad_request
from spillway.protocol.hashing import pack_token_ids, token_id_array

PROMPT_SHAPES = "prompt must be a string, a list of token ids, or a list of either"


@dataclass(slots=True)
class Prompt:
    token_ids: Sequence[int]  # a list until `pack_in_vocab`, then an array of uint32
    text: str | None = None
    # `token_ids` as `pack_token_ids` packs them; set once they are known to lie in [0, 2**32).
    packed: bytes | None = None

    def pack_in_vocab(self, vocab_size: int) -> bool:
        """Whether every id lies in [0, vocab_size); those of a prompt that passes are kept
        packed and as an array (see the module docstring). Packed ids are unsigned, so their
        numpy maximum is the whole range check (~4 us for 10k ids, where a scan of the list
        takes ~90 us)."""
        import numpy  # here, not at the top: `spillway serve --help` and the like start without it (~0.1 s)

        packed = self.packed
        if packed is None:
            try:
                packed = pack_token_ids(self.token_ids)
            except OverflowError:
                return False
        if packed and int(numpy.frombuffer(packed, dtype="<u4").max()) >= vocab_size:
            return False
        self.packed, self.token_ids = packed, token_id_array(packed)
        return True

    def truncated(self, keep: int) -> Prompt:
        """The last `keep` ids (keep >= 1), packed too where they were."""
        packed = None if self.packed is None else self.packed[-4 * keep:]
        return Prompt(self.token_ids[-keep:], self.text, packed)


def token_id_prompt(ids: list) -> Prompt:
    """A prompt given as one JSON list of ids (its items decoded as ints, strings or lists):
    packed in one pass in C, which refuses a string or list among them (a 400); an id outside
    [0, 2**32) leaves it unpacked, to be refused with the others outside the vocabulary once
    the lengths have been checked."""
    try:
        return Prompt(ids, packed=pack_token_ids(ids))
    except TypeError:
        raise bad_request(PROMPT_SHAPES, param="prompt") from None
    except OverflowError:
        try:  # a string after the id that overflowed is still a wrong shape, not a wrong id
            return Prompt(msgspec.convert(ids, list[int]))
        except msgspec.ValidationError:
            raise bad_request(PROMPT_SHAPES, param="prompt") from None
