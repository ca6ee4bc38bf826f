"""The one-shot Lamport push protocol: mailbox layout, sentinel, generation state.

Each rank owns a mailbox ``[GENERATIONS, tp, capacity, H]`` bf16, filled with the sentinel
0x8000 (bf16 -0.0). A call publishes rank r's contribution into slot r of generation g of *every*
rank's mailbox; the consumer spins on its own mailbox until no lane equals the sentinel, reduces,
and re-arms exactly the slots it consumed.

Why three generations: a peer can run at most one call ahead of this rank (its consumer for call
n+1 needs this rank's publish n+1, which comes after this rank's consumer n), so while this rank
reads generation g, peers may already write g+1; a slot re-armed in call n is next written in
call n+3.

Generation state (int32 words in device memory, advanced by the kernels so CUDA graph replay
works; choosing the generation on the host would freeze it into the graph):

* ``state[PUBLISH_GENERATION]``: generation the next publish writes. Read by every publish CTA;
  written only by the consumer (CTA 0), after which the next publish's griddepcontrol.wait
  orders the read.
* ``state[CONSUME_GENERATION]``: generation the consumer reads. Written by the publish (CTA 0,
  thread 0) with the generation it used; read by every consumer CTA after griddepcontrol.wait.

Two words, one writer each per kernel, so no CTA ever reads a word that another CTA of the same
grid writes.
"""

from __future__ import annotations

GENERATIONS = 3
SENTINEL_BF16 = 0x8000  # bf16 -0.0: "not yet written"
SENTINEL_WORD = (SENTINEL_BF16 << 16) | SENTINEL_BF16

PUBLISH_GENERATION = 0
CONSUME_GENERATION = 1
STATE_WORDS = 4  # two used; padded to 16 bytes

MAX_TP = 8


def mailbox_shape(tp: int, capacity: int, hidden_size: int) -> tuple[int, int, int, int]:
    return (GENERATIONS, tp, capacity, hidden_size)


def slot_byte_offset(generation, rank, token, hidden_size: int, tp: int, capacity: int):
    """Byte offset of mailbox[generation, rank, token, 0] (works on ints and DSL integers)."""
    return ((generation * tp + rank) * capacity + token) * (hidden_size * 2)
