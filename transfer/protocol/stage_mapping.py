"""Pipeline parallelism on either side: which layers each (prefill stage, decode stage) pair
moves, decided without sockets (the layer-axis mapping beside the head mapping).

A PP engine's stages tile the model's layers [0, num_layers) in stage order, each stage's ranks
holding only their stage's layers (KVLayout.stage). Any PP size may meet any other: a decode
rank of stage [a, b) receives layer l from the ranks of the prefill stage holding l, so it
deals with every prefill stage overlapping [a, b), each writing the overlap only; a prefill
rank writes the overlap of its stage with each decode stage that overlaps it. Within one pair
of stages the head mapping (head_mapping.py) is the same as without PP, as every stage of an
engine has the same TP size. The state pools of no layer go with the stage holding the
model's last layer (its last layer's write carries them), on both sides, and so does the
draft: the last stage of each engine holds the draft's entries, which follow the model's last
layer as entries [num_layers, num_layers + draft entries) and pair as more layers of the last
stages (a prefill rank sees a decode's last stage going on over the draft entries it writes,
`decode_stage_of`; a decode rank sees the prefill's, peering.read_stages).

A decode rank knows its own stage only; a prefill rank learns the decode stages from the
decode ranks that contact it (their Hello), and a room's set of decode ranks is complete once
the decode stages seen cover its own stage (`DecodeCoverage`): stages of one engine are
disjoint, so no other decode stage can still overlap it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from .messages import KVMemory


def overlap(a: range, b: range) -> range:
    """The layers both step-1 ranges hold (empty when disjoint)."""
    lo, hi = max(a.start, b.start), min(a.stop, b.stop)
    return range(lo, max(lo, hi))


def stages_text(stages: Iterable[range]) -> str:
    """A PP layout as people read it: 'PP 2 [0, 3) [3, 6)'."""
    s = list(stages)
    return f"PP {len(s)} " + " ".join(f"[{x.start}, {x.stop})" for x in s)


@dataclass(frozen=True)
class DecodeStage:
    """What a decode rank tells the prefill ranks it connects (Hello.pp_size, stage_start,
    stage_stop): its engine's PP size, its stage's index and layers."""

    pp_size: int
    pp_rank: int
    layers: range    # the last stage's goes on over the draft entries the prefill writes (decode_stage_of)

    def model_layers(self, num_layers: int) -> range:
        """Its model layers, without the draft entries after them."""
        return range(self.layers.start, min(self.layers.stop, num_layers))

    def text(self) -> str:
        return f"decode PP stage {self.pp_rank} of {self.pp_size} [{self.layers.start}, {self.layers.stop})"


def sources_of(prefill_stages: tuple[range, ...], decode_stage: range) -> dict[int, range]:
    """Prefill stage index -> the layers of `decode_stage` it holds, for every prefill stage
    that overlaps it (in stage order). Raises ValueError naming both layouts when the prefill
    stages leave a layer of the decode stage uncovered (they were checked to tile the model
    by peering.read_stages, so this only happens when the two sides disagree on the model)."""
    out = {s: lay for s, stage in enumerate(prefill_stages) if len(lay := overlap(stage, decode_stage))}
    if sum(len(x) for x in out.values()) != len(decode_stage):
        raise ValueError(f"the prefill's {stages_text(prefill_stages)} does not hold every layer of this decode "
                         f"rank's stage [{decode_stage.start}, {decode_stage.stop})")
    return out


@dataclass(frozen=True)
class Coverage:
    """What a prefill rank makes of the decode stages it heard from, for one room."""

    expected: frozenset[int]     # the decode engine ranks it writes (or notifies) so far
    complete: bool               # the stages seen cover this rank's stage: nobody else is coming
    error: str = ""              # the decode stages cannot pair with this one: why (both layouts)


def decode_coverage(my_stage: range, tp_peers: Iterable[int], decode_tp: int,
                    seen: Mapping[int, DecodeStage], num_entries: int) -> Coverage:
    """The decode ranks a prefill rank of stage `my_stage` deals with in a room, from the
    stages of the decode ranks whose metadata arrived (`seen`: decode engine rank -> its
    stage). `tp_peers`: the decode TP ranks of one stage the head mapping gives this rank
    (HeadMapping.decode_peers_of). Every seen stage overlapping `my_stage` contributes its
    ranks `pp_rank * decode_tp + t`; complete once they cover `my_stage`. Error when the seen
    stages disagree on the PP size, are out of stage order, overlap or leave a gap between
    neighbours, the first does not start at layer 0 or the last end at `num_entries` (the
    model's layers, then the draft entries this prefill rank writes: decode_stage_of), or one
    does not overlap `my_stage`."""
    peers = sorted(set(tp_peers))
    stages: dict[int, DecodeStage] = {}
    for rank, st in sorted(seen.items()):
        if rank // decode_tp != st.pp_rank:
            return Coverage(frozenset(), False, f"decode rank {rank} (TP {decode_tp}) says it is in "
                                                f"{st.text()}")
        prev = stages.setdefault(st.pp_rank, st)
        if prev != st:
            return Coverage(frozenset(), False, f"decode ranks disagree on their stage: {prev.text()} vs {st.text()}")
    sizes = {st.pp_size for st in stages.values()}
    if len(sizes) > 1:
        return Coverage(frozenset(), False, f"decode ranks disagree on their PP size: {sorted(sizes)}")
    ordered = sorted(stages.values(), key=lambda s: s.pp_rank)
    for a, b in zip(ordered, ordered[1:]):
        if a.layers.stop > b.layers.start:
            return Coverage(frozenset(), False, f"decode stages overlap or are out of order: {a.text()} and {b.text()}")
        if b.pp_rank == a.pp_rank + 1 and a.layers.stop != b.layers.start:
            return Coverage(frozenset(), False, f"decode stages leave layers [{a.layers.stop}, {b.layers.start}) to "
                                                f"no stage: {a.text()} and {b.text()}")
    for st in ordered:
        if st.pp_rank == 0 and st.layers.start != 0:
            return Coverage(frozenset(), False, f"{st.text()} does not start at layer 0")
        if st.pp_rank == st.pp_size - 1 and st.layers.stop != num_entries:
            return Coverage(frozenset(), False, f"{st.text()} does not end at the model's last layer ({num_entries} "
                                                f"entries)")
    mine = f"[{my_stage.start}, {my_stage.stop})"
    for st in ordered:
        if not len(overlap(st.layers, my_stage)):
            return Coverage(frozenset(), False, f"{st.text()} holds none of this prefill stage's layers {mine}")
    expected = frozenset(st.pp_rank * decode_tp + t for st in ordered for t in peers)
    covered = sum(len(overlap(st.layers, my_stage)) for st in ordered)
    return Coverage(expected, covered == len(my_stage))


def uncovered(my_stage: range, stages: Iterable[DecodeStage]) -> list[int]:
    """The layers of `my_stage` no decode stage in `stages` holds."""
    held = {layer for st in stages for layer in st.layers}
    return [layer for layer in my_stage if layer not in held]


def flow_layers(my_stage: range, decode_stage: DecodeStage | None) -> range:
    """The layers a prefill rank of `my_stage` writes to a decode rank of `decode_stage`
    (None: a decode rank without PP, which holds every layer)."""
    return my_stage if decode_stage is None else overlap(my_stage, decode_stage.layers)


def by_model_layer(addrs: list[int], num_kv: int, first_layer: int) -> list[int]:
    """A decode stage's per-tensor addresses (K of each of its layers, then V of each) indexed
    by model layer instead: `first_layer` zeros (layers it does not hold, never written) before
    each kind's run, so that entry `kv * (first_layer + held) + l` is model layer l's."""
    if first_layer == 0:
        return list(addrs)
    per, odd = divmod(len(addrs), num_kv)
    if odd:
        raise ValueError(f"{len(addrs)} tensor addresses are not {num_kv} per layer")
    out: list[int] = []
    for kv in range(num_kv):
        out += [0] * first_layer + list(addrs[kv * per:(kv + 1) * per])
    return out


def stage_memory(kv: KVMemory, stage: DecodeStage | None) -> KVMemory:
    """A decode stage's KV memory (its Hello's) indexed by model layer (`by_model_layer`), so
    that a prefill rank's direct writes address its tensors by the model layers they carry."""
    if stage is None or stage.layers.start == 0:
        return kv
    first = stage.layers.start
    return msgspec.structs.replace(kv, k_addrs=by_model_layer(kv.k_addrs, 1, first),
                                   v_addrs=by_model_layer(kv.v_addrs, 1, first) if kv.v_addrs else [])


def decode_stage_of(*, pp_size: int, tp_size: int, rank: int, stage_start: int, stage_stop: int,
                    num_layers: int, draft_layers: int = 0) -> tuple[DecodeStage | None, list[str]]:
    """A decode rank's PP stage from its Hello (None: no PP there), and what is wrong with it
    (empty: nothing). `rank`: its engine rank, `tp_size`: one stage's TP size. The last stage
    (it ends at the model's last layer) goes on over the `draft_layers` entries the asking
    prefill rank writes after the model's layers (KVLayout.draft_layers): the decode's draft
    lives there too, holding at least those entries (draft_kv.draft_mismatch)."""
    if pp_size <= 1:
        return None, []
    stop = stage_stop + draft_layers if stage_stop == num_layers else stage_stop
    st = DecodeStage(pp_size, rank // max(tp_size, 1), range(stage_start, stop))
    if not 0 <= stage_start < stage_stop <= num_layers or not 0 <= st.pp_rank < pp_size:
        return st, [f"decode rank {rank} of TP {tp_size} says it is in {st.text()}, which is not a stage of this "
                    f"model's {num_layers} layers"]
    return st, []
