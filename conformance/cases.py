"""The case matrix is data: named cases with readable ids and seeds derived from those ids.

A `Case` is one call of the fused operation on the emulated TP group: its shape (tp, hidden,
hc, M), its kind (`op`: a plain call or a MoE finalize), what the consumer writes (`variant`)
and how its inputs are drawn (`family`, see conformance.inputs). The id names all of them,
e.g. ``tp4-H5120-hc4-M129-finalize-mxfp8-normal``, and the seed is a hash of the id, so any
case re-runs alone (`python -m conformance run --case ID`).

Presets:
* ``full``: TP x H x hc x M x op x variant (3456 cases), each with one input family assigned
  from its shape so that every family appears with every value of every axis, and the wide
  form's edge (36 cases: TP 1, hc 8, M 1023 and 1024, every H, op and variant; see
  WIDE_FORM_TOKEN_COUNTS): 3492 cases;
* ``default``: every TP x H x hc x op x variant combination with four M values, one from each
  quarter of the M list, cycling (1152 cases), and the wide form's first M, 1024 (18 cases):
  1170 cases;
* ``quick``: every TP x op x variant combination at a small and a real hidden size, hc and M
  cycling (48 cases), for CI minutes.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from mhc_ar.config import MAX_HC, MXFP8_BLOCK, REGISTER_BOUND_MAX_HC, VECTOR_ELEMS, WIDE_FORM_MIN_TOKENS, Contribution, Variant
from mhc_ar.protocol import MAX_TP

TP_SIZES = (1, 2, 4, 8)
HIDDEN_SIZES = (4096, 5120, 7168)
HC_VALUES = (1, 2, 4, 8)
# Token counts around the kernel's edges: tiny M, one short of / at / one past the 128-row
# MXFP8 scale tile, and the capacity itself.
TOKEN_COUNTS = (1, 2, 3, 5, 8, 16, 31, 64, 127, 128, 129, 256)
CAPACITY = 256
# One more edge, past the capacity: at tp = 1 with hc > 4 a call of WIDE_FORM_MIN_TOKENS tokens
# launches the consumer's wide form and one of a token fewer its narrow form
# (mhc_ar.config.ConsumerSpec.wide). The full preset takes both counts and the default preset the
# first wide one, for every hidden size, op and variant, on instances of exactly
# WIDE_FORM_MIN_TOKENS tokens; the quick preset and runs given --m take neither.
WIDE_FORM_TOKEN_COUNTS = (WIDE_FORM_MIN_TOKENS - 1, WIDE_FORM_MIN_TOKENS)
WIDE_FORM_CAPACITY = WIDE_FORM_MIN_TOKENS
FINALIZE_TOP_K = 8
# The mxfp8 variant's hidden sizes: whole groups of 4 MXFP8 blocks, the 4 scale columns of the
# 128x4 scale swizzle (as mhc_ar.config's ConsumerSpec requires).
MXFP8_HIDDEN_MULTIPLE = 4 * MXFP8_BLOCK
# The quick preset adds a small hidden size (one CTA, 16 vectors) so a CI run stays short.
QUICK_HIDDEN_SIZES = (128, 4096)
# The default preset gives each combination this many M values, one from each stretch of
# TOKEN_COUNTS (len(TOKEN_COUNTS) / DEFAULT_M_PER_COMBINATION apart).
DEFAULT_M_PER_COMBINATION = 4

OPS = tuple(Contribution)
VARIANTS = tuple(Variant)


class Family(str, enum.Enum):
    """How a case's inputs are drawn (conformance.inputs builds them)."""

    NORMAL = "normal"  # N(0,1) activations, positive mix coefficients
    WIDE_RANGE = "wide_range"  # magnitudes 2^-60 .. 2^60
    SIGNED_ZEROS = "signed_zeros"  # many exact +-0.0, whole ranks of -0.0 (the sentinel value)
    NAN_INF = "nan_inf"  # NaN (several payloads) and +-Inf sprinkled in
    ORDER_SENSITIVE = "order_sensitive"  # 2^24, 1, -2^24: any change of summation order shows
    TINY = "tiny"  # subnormal fp32 intermediates, MXFP8 block amax near 2^-118
    CAPTURED = "captured"  # recorded from a real call (mhc_ar.capture), not drawn


# The families the matrix draws inputs from (a captured call's inputs are recorded, not drawn).
FAMILIES = tuple(f for f in Family if f is not Family.CAPTURED)


class Preset(str, enum.Enum):
    QUICK = "quick"
    DEFAULT = "default"
    FULL = "full"


_ID_PATTERN = re.compile(
    r"^tp(?P<tp>\d+)-H(?P<hidden>\d+)-hc(?P<hc>\d+)-M(?P<m>\d+)-(?P<op>[a-z_]+)-(?P<variant>[a-z0-9_]+)"
    r"-(?P<family>[a-z_]+)(?:-cap(?P<capacity>\d+))?$"
)
_SEED_MODULUS = 2**63


@dataclass(frozen=True)
class Case:
    """One call of the operation on an emulated TP group of `tp` ranks.

    top_k is FINALIZE_TOP_K for finalize and 0 for a plain call unless given; capacity is the
    instance's max_num_tokens (M <= capacity). seed_offset shifts the id-derived seed.
    """

    tp: int
    hidden: int
    hc: int
    m: int
    op: Contribution
    variant: Variant
    family: Family
    top_k: int = -1  # -1: FINALIZE_TOP_K for finalize, 0 for call
    capacity: int = CAPACITY
    seed_offset: int = field(default=0, compare=True)

    def __post_init__(self):
        object.__setattr__(self, "op", Contribution(self.op))
        object.__setattr__(self, "variant", Variant(self.variant))
        object.__setattr__(self, "family", Family(self.family))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", FINALIZE_TOP_K if self.op is Contribution.FINALIZE else 0)
        for name in ("tp", "hidden", "hc", "m", "top_k", "capacity", "seed_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if not 1 <= self.tp <= MAX_TP:
            raise ValueError(f"tp must be in 1..{MAX_TP}, got {self.tp}")
        if self.hidden <= 0 or self.hidden % VECTOR_ELEMS:
            raise ValueError(f"hidden must be a positive multiple of {VECTOR_ELEMS}, got {self.hidden}")
        if self.variant is Variant.MXFP8 and self.hidden % MXFP8_HIDDEN_MULTIPLE:
            raise ValueError(f"the mxfp8 variant needs hidden % {MXFP8_HIDDEN_MULTIPLE} == 0, got {self.hidden}")
        if not 1 <= self.hc <= MAX_HC:
            raise ValueError(f"hc must be in 1..{MAX_HC}, got {self.hc}")
        if not 1 <= self.m <= self.capacity:
            raise ValueError(f"m must be in 1..capacity={self.capacity}, got {self.m}")
        if self.op is Contribution.FINALIZE and self.top_k < 1:
            raise ValueError(f"a finalize case needs top_k >= 1, got {self.top_k}")
        if self.op is Contribution.CALL and self.top_k != 0:
            raise ValueError(f"a call case has top_k 0, got {self.top_k}")

    @property
    def id(self) -> str:
        text = f"tp{self.tp}-H{self.hidden}-hc{self.hc}-M{self.m}-{self.op.value}-{self.variant.value}-{self.family.value}"
        if self.capacity != CAPACITY:
            text += f"-cap{self.capacity}"
        return text

    @property
    def seed(self) -> int:
        """sha256 of the id (first 8 bytes, big-endian) plus seed_offset, modulo 2^63."""
        digest = hashlib.sha256(self.id.encode()).digest()
        return (int.from_bytes(digest[:8], "big") + self.seed_offset) % _SEED_MODULUS

    @property
    def instance_key(self) -> tuple:
        """What an EmulatedAllReduceMHC instance is built from: cases sharing it share one."""
        return (self.tp, self.hidden, self.hc, self.capacity, self.top_k, self.variant)

    @property
    def repro_command(self) -> str:
        command = f"python -m conformance run --case {self.id}"
        if self.seed_offset:
            command += f" --seed-offset {self.seed_offset}"
        return command

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "tp": self.tp,
            "hidden": self.hidden,
            "hc": self.hc,
            "m": self.m,
            "op": self.op.value,
            "variant": self.variant.value,
            "family": self.family.value,
            "top_k": self.top_k,
            "capacity": self.capacity,
            "seed_offset": self.seed_offset,
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Case":
        """Inverse of to_dict; raises ValueError if the fields are missing, invalid or disagree
        with the recorded id/seed."""
        if not isinstance(data, dict):
            raise ValueError(f"case must be a JSON object, got {type(data).__name__}")
        names = ("tp", "hidden", "hc", "m", "op", "variant", "family", "top_k", "capacity", "seed_offset")
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"case is missing {', '.join(missing)}")
        try:
            case = cls(**{n: data[n] for n in names})
        except (TypeError, ValueError) as error:
            raise ValueError(f"invalid case: {error}") from None
        if "id" in data and data["id"] != case.id:
            raise ValueError(f"case id {data['id']!r} does not match its fields ({case.id})")
        if "seed" in data and data["seed"] != case.seed:
            raise ValueError(f"case seed {data['seed']!r} does not match its id (expected {case.seed})")
        return case

    @classmethod
    def from_id(cls, case_id: str, seed_offset: int = 0) -> "Case":
        match = _ID_PATTERN.match(case_id.strip())
        if not match:
            raise ValueError(
                f"not a case id: {case_id!r} (expected e.g. tp4-H5120-hc4-M129-finalize-mxfp8-normal)"
            )
        g = match.groupdict()
        try:
            return cls(
                tp=int(g["tp"]),
                hidden=int(g["hidden"]),
                hc=int(g["hc"]),
                m=int(g["m"]),
                op=Contribution(g["op"]),
                variant=Variant(g["variant"]),
                family=Family(g["family"]),
                capacity=int(g["capacity"]) if g["capacity"] else CAPACITY,
                seed_offset=seed_offset,
            )
        except ValueError as error:
            raise ValueError(f"case id {case_id!r}: {error}") from None


# ----- presets ----------------------------------------------------------------------------------


def _position(value, axis: Sequence) -> int:
    """Index of value on its axis; values outside the matrix (e.g. H=128) get a stable index."""
    return axis.index(value) if value in axis else len(axis) + int(value)


def assigned_family(tp: int, hidden: int, hc: int, m: int, op: Contribution, variant: Variant) -> Family:
    """The input family of a shape: the axis positions summed, modulo the number of families.

    For any fixed value of one axis the other positions still sum to every residue, so every
    family appears with every value of every axis (tests check this for each preset).
    """
    index = (
        _position(tp, TP_SIZES)
        + _position(hidden, HIDDEN_SIZES)
        + _position(hc, HC_VALUES)
        + _position(m, TOKEN_COUNTS)
        + OPS.index(Contribution(op))
        + VARIANTS.index(Variant(variant))
    )
    return FAMILIES[index % len(FAMILIES)]


Shape = tuple  # (tp, hidden, hc, m, op, variant)


@dataclass(frozen=True)
class Filters:
    """The axes a run is restricted to (None: the preset's). An axis given replaces the
    preset's values on that axis: the run takes every given value crossed with the preset's
    choices on the axes not given (so values the preset lacks, e.g. tp=3 or H=1000, run too).
    `family`: None keeps each shape's assigned family; a list crosses every shape with those
    families (all of FAMILIES for --family all)."""

    tp: tuple[int, ...] | None = None
    hidden: tuple[int, ...] | None = None
    hc: tuple[int, ...] | None = None
    m: tuple[int, ...] | None = None
    op: tuple[Contribution, ...] | None = None
    variant: tuple[Variant, ...] | None = None
    family: tuple[Family, ...] | None = None

    def to_dict(self) -> dict:
        out = {}
        for name in ("tp", "hidden", "hc", "m", "op", "variant", "family"):
            value = getattr(self, name)
            if value is not None:
                out[name] = [v.value if isinstance(v, enum.Enum) else v for v in value]
        return out

    def validate(self) -> None:
        """A ValueError naming the option and its rule for any value no case can have."""
        rules = (
            ("tp", lambda v: 1 <= v <= MAX_TP, f"TP sizes are 1..{MAX_TP}"),
            ("hidden", lambda v: v > 0 and v % VECTOR_ELEMS == 0, f"hidden sizes are positive multiples of {VECTOR_ELEMS}"),
            ("hc", lambda v: 1 <= v <= MAX_HC, f"hc is 1..{MAX_HC}"),
            ("m", lambda v: 1 <= v <= CAPACITY, f"M is 1..{CAPACITY} (the capacity of the run's instances)"),
        )
        for name, ok, rule in rules:
            for value in getattr(self, name) or ():
                if not ok(value):
                    raise ValueError(f"--{name} {value}: {rule}")
        if self.variant is not None and Variant.MXFP8 in self.variant:
            for hidden in self.hidden or ():
                if hidden % MXFP8_HIDDEN_MULTIPLE:
                    raise ValueError(
                        f"--hidden {hidden} with --variant mxfp8: the mxfp8 variant needs hidden % {MXFP8_HIDDEN_MULTIPLE} == 0"
                    )

    def axes(self, tp, hidden, hc, ops, variants) -> tuple:
        """The preset's axes with the given ones in their place."""
        return (self.tp or tp, self.hidden or hidden, self.hc or hc, self.op or ops, self.variant or variants)


def _full_shapes(filters: Filters) -> list[Shape]:
    tps, hiddens, hcs, ops, variants = filters.axes(TP_SIZES, HIDDEN_SIZES, HC_VALUES, OPS, VARIANTS)
    return list(itertools.product(tps, hiddens, hcs, filters.m or TOKEN_COUNTS, ops, variants)) + _wide_form_shapes(
        filters, WIDE_FORM_TOKEN_COUNTS)


def _wide_form_shapes(filters: Filters, counts: Sequence[int]) -> list[Shape]:
    """The wide form's edge (WIDE_FORM_TOKEN_COUNTS) on the filters' tp = 1, hc > 4 axes."""
    if filters.m:
        return []
    tps, hiddens, hcs, ops, variants = filters.axes(TP_SIZES, HIDDEN_SIZES, HC_VALUES, OPS, VARIANTS)
    hcs = [hc for hc in hcs if hc > REGISTER_BOUND_MAX_HC]
    return list(itertools.product([tp for tp in tps if tp == 1], hiddens, hcs, counts, ops, variants))


def _index(values_and_axes) -> int:
    """Mixed-radix index of a combination by each value's position on its preset axis: the
    enumeration index for the preset's own values, a stable one for values it lacks."""
    index = 0
    for value, axis in values_and_axes:
        index = index * len(axis) + _position(value, axis)
    return index


def _default_shapes(filters: Filters) -> list[Shape]:
    shapes = []
    stride = len(TOKEN_COUNTS) // DEFAULT_M_PER_COMBINATION
    for tp, hidden, hc, op, variant in itertools.product(*filters.axes(TP_SIZES, HIDDEN_SIZES, HC_VALUES, OPS, VARIANTS)):
        c = _index(((tp, TP_SIZES), (hidden, HIDDEN_SIZES), (hc, HC_VALUES), (op, OPS), (variant, VARIANTS)))
        ms = filters.m or [TOKEN_COUNTS[(c + stride * k) % len(TOKEN_COUNTS)] for k in range(DEFAULT_M_PER_COMBINATION)]
        shapes += [(tp, hidden, hc, m, op, variant) for m in ms]
    return shapes + _wide_form_shapes(filters, WIDE_FORM_TOKEN_COUNTS[-1:])


def _quick_shapes(filters: Filters) -> list[tuple[Shape, Family]]:
    """Families cycle with a skip every 7 cases (i + 5 * (i // 7)): a plain cycle of 6 would
    line up with the 2 x 3 x 2 inner loops and give each variant only two families. With the
    skip, each TP, hidden, hc, op and variant value meets every family (tests check it)."""
    shapes = []
    tps, hiddens, _, ops, variants = filters.axes(TP_SIZES, QUICK_HIDDEN_SIZES, HC_VALUES, OPS, VARIANTS)
    for tp, op, variant, hidden in itertools.product(tps, ops, variants, hiddens):
        i = _index(((tp, TP_SIZES), (op, OPS), (variant, VARIANTS), (hidden, QUICK_HIDDEN_SIZES)))
        hcs = filters.hc or (HC_VALUES[(i + i // len(QUICK_HIDDEN_SIZES)) % len(HC_VALUES)],)
        # 5 is coprime with len(TOKEN_COUNTS): M walks through every count, small and large mixed.
        ms = filters.m or (TOKEN_COUNTS[(5 * i) % len(TOKEN_COUNTS)],)
        family = FAMILIES[(i + 5 * (i // 7)) % len(FAMILIES)]
        shapes += [((tp, hidden, hc, m, op, variant), family) for hc in hcs for m in ms]
    return shapes


def _preset_shapes(preset: Preset, filters: Filters) -> list[tuple[Shape, Family]]:
    if preset is Preset.QUICK:
        return _quick_shapes(filters)
    shapes = _full_shapes(filters) if preset is Preset.FULL else _default_shapes(filters)
    return [(shape, assigned_family(*shape)) for shape in shapes]


def preset_cases(preset: Preset | str, filters: Filters = Filters(), *, seed_offset: int = 0) -> list[Case]:
    """The cases of a preset on the filters' axes, in matrix order, ids unique. Shapes the
    mxfp8 variant cannot take (hidden % MXFP8_HIDDEN_MULTIPLE) are left out when the variant axis is the preset's
    (Filters.validate refuses them when it is given)."""
    preset = Preset(preset)
    cases: dict[str, Case] = {}
    for shape, assigned in _preset_shapes(preset, filters):
        tp, hidden, hc, m, op, variant = shape
        if Variant(variant) is Variant.MXFP8 and hidden % MXFP8_HIDDEN_MULTIPLE:
            continue
        families = filters.family if filters.family is not None else (assigned,)
        for family in families:
            capacity = CAPACITY if m <= CAPACITY else WIDE_FORM_CAPACITY
            case = Case(tp=tp, hidden=hidden, hc=hc, m=m, op=op, variant=variant, family=family, capacity=capacity,
                        seed_offset=seed_offset)
            cases.setdefault(case.id, case)
    return list(cases.values())


def cases_from_ids(ids: Iterable[str], *, seed_offset: int = 0) -> list[Case]:
    cases: dict[str, Case] = {}
    for case_id in ids:
        case = Case.from_id(case_id, seed_offset=seed_offset)
        cases.setdefault(case.id, case)
    return list(cases.values())


def parse_list(text: str, convert, name: str) -> tuple:
    """A comma list from the command line, each item converted (ValueError naming the option)."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ValueError(f"--{name}: empty list")
    if not all(items):
        raise ValueError(f"--{name}: empty item in {text!r}")
    out = []
    for item in items:
        try:
            out.append(convert(item))
        except ValueError:
            raise ValueError(f"--{name}: invalid value {item!r}") from None
    return tuple(dict.fromkeys(out))


def parse_families(text: str) -> tuple[Family, ...]:
    if text.strip() == "all":
        return FAMILIES
    families = parse_list(text, Family, "family")
    if Family.CAPTURED in families:
        raise ValueError("--family: 'captured' inputs are recorded by mhc_ar.capture, not drawn; replay them with repro")
    return families
