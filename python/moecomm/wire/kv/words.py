"""Where a KV pool's bytes and words sit: the byte offsets of each part in the data memory, and
of each transfer slot's words (armed, status, one per layer) and failure reason in the control
region, computed from the layout alone so both ends agree; and the completion words themselves
(``seq << SEQ_SHIFT | state``), which make a late or stray write of an earlier transfer in the
same slot harmless."""

from __future__ import annotations

from enum import IntEnum

from moecomm.wire.kv.layout import KvLayout

# Each part of the pool starts on its own page: a run's copy never shares a page with another
# part, and page-aligned copies take the kernel's and libc's fastest paths.
PART_ALIGN = 4096
# The reason a failing sender leaves in the slot; longer reasons are cut (a multiple of LINE).
REASON_BYTES = 256
# A signal word's line: the shm transport keeps its futex sleeper count beside the word.
LINE = 64  # kSignalWordAlign, csrc/transport/transport.h
# A word is ``seq << SEQ_SHIFT | state``; the sequence number takes the upper 56 bits.
SEQ_SHIFT = 8
STATE_MASK = (1 << SEQ_SHIFT) - 1
SEQ_MASK = ~STATE_MASK & ((1 << 64) - 1)
MAX_SEQ = (1 << (64 - SEQ_SHIFT)) - 1


class WordState(IntEnum):
    """The low byte of a completion word."""

    IDLE = 0
    LAYER_DONE = 1  # a layer word: every block of that layer is written
    DONE = 2  # the status word: every layer is written
    FAILED = 3  # the sender gave up; the slot's reason says why


class KvState(IntEnum):
    """What :meth:`KvRecv.poll` reports (SGLang's poll states, without bootstrapping)."""

    WAITING = 0  # no layer arrived yet
    TRANSFERRING = 1  # some layers arrived
    DONE = 2
    FAILED = 3


def make_word(seq: int, state: WordState) -> int:
    """The completion word of transfer `seq` in `state`."""
    return (seq << SEQ_SHIFT) | int(state)


class Geometry:
    """Byte offsets in a pool's regions, the same on both ends (computed from the layout)."""

    def __init__(self, layout: KvLayout, max_transfers: int):
        self.part_offsets = []
        offset = 0
        for p in layout.parts:
            self.part_offsets.append(offset)
            offset += -(-p.block_bytes * layout.num_blocks // PART_ALIGN) * PART_ALIGN
        self.data_bytes = offset
        # Control region: per slot, the armed word (the receiver's), the status word, one word
        # per layer, each on its own signal line (the transport's futex bookkeeping shares the
        # line), then the reason; slots span whole lines.
        self.num_layers = layout.num_layers
        self.slot_bytes = LINE * (2 + layout.num_layers) + REASON_BYTES
        self.control_bytes = self.slot_bytes * max_transfers

    def armed(self, slot: int) -> int:
        return slot * self.slot_bytes

    def status(self, slot: int) -> int:
        return slot * self.slot_bytes + LINE

    def layer(self, slot: int, layer: int) -> int:
        return slot * self.slot_bytes + LINE * (2 + layer)

    def reason(self, slot: int) -> int:
        return slot * self.slot_bytes + LINE * (2 + self.num_layers)


# The names this module had inside the single-file kv module.
_Geometry = Geometry
_word = make_word
