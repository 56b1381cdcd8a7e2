"""An evidence folder (``vllm-patch bench --out DIR``) parsed once into frozen
records, for ``evidence.md`` and a PR description alike (``bench_result``
renders only these). The file is data: every value is checked for its type and
bounded (counts, string lengths, number sizes); anything else is one
``PatchError`` (exit 3) naming the field.

``DIR/evidence.json`` holds ``schema``, ``machine`` (``runtime.machine.facts``),
``load``, ``vllm`` (``base``, ``patched``, ``patch``), ``model`` (``name``,
``description``, ``random_weights``), ``serving`` (``commands``, ``sizes``, per
mode, side and metric the value of each repetition: ``configs``; ``server_log``),
``accuracy`` (``tokens``, ``lm_eval``), ``numerics`` and ``tolerance``, ``perop``,
``qwen3_eager``, ``decode`` (``docs/bench.md``), ``interrupted`` and ``failed``;
a part not measured is None.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patcher.errors import PatchError

SCHEMA = 1
EVIDENCE = "evidence.json"
NATIVE = "native"
"""vLLM's own PyTorch implementation of an op: every ratio's baseline."""
MODES = ("eager", "compiled")
SIDES = ("base", "patched")
A_A = "base2"
"""The base served again: ``--serve``'s A/A control (older evidence lacks it)."""
SERVED = (*SIDES, A_A)
METRICS = (
    "request_throughput", "output_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
)  # fmt: skip
"""``vllm bench serve --save-result``'s names for what the table shows."""
LONGEST = 4000
"""The longest string read (a command); names are cut shorter when rendered."""
MANY = 200
"""The most entries of a list or table (repetitions, commands, log lines)."""
MOST_ROWS = 2000
"""The most per-op rows (a run writes a few dozen)."""
MOST_THREADS = 8
"""The most other thread counts a ``perop`` comes at (``perop_threads``)."""
MOST_COLUMNS = 24
"""The most (vLLM, route) pairs in the per-op table."""
LARGEST = 1e15
"""No figure's magnitude is larger (a 400-digit integer is not a figure)."""


class Bad(Exception):
    """A field that is not what ``bench`` writes: its dotted name, and why."""


def _get(data: object, where: str, key: str) -> tuple[object, str]:
    if not isinstance(data, dict):
        raise Bad(f"{where or 'the document'}: not a table")
    return data.get(key), f"{where}.{key}" if where else key


def _table(value: object, where: str, keys=None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Bad(f"{where}: not a table")
    if len(value) > MANY:
        raise Bad(f"{where}: more than {MANY} entries")
    for key in value:
        if keys is not None and key not in keys:
            raise Bad(f"{where}.{_cut(key)}: not one of {', '.join(keys)}")
        _text(key, where)
    return value


def _list(value: object, where: str, most: int = MANY) -> list:
    if not isinstance(value, list):
        raise Bad(f"{where}: not a list")
    if len(value) > most:
        raise Bad(f"{where}: more than {most} entries")
    return value


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise Bad(f"{where}: not a string")
    if len(value) > LONGEST:
        raise Bad(f"{where}: longer than {LONGEST} characters")
    return value


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Bad(f"{where}: not a number")
    if not abs(value) <= LARGEST:  # NaN and infinities too
        raise Bad(f"{where}: not a finite number of at most {LARGEST:g}")
    return value


def _time(value: object, where: str) -> float:
    if not _number(value, where) > 0:
        raise Bad(f"{where}: not a time above 0")
    return value


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Bad(f"{where}: not a whole number")
    if not 0 <= value <= 10**7:
        raise Bad(f"{where}: not a count from 0 to 10,000,000")
    return value


def _opt(read, data: object, where: str, key: str, *extra):
    value, at = _get(data, where, key)
    return None if value is None else read(value, at, *extra)


def _req(read, data: object, where: str, key: str, *extra):
    value, at = _get(data, where, key)
    if value is None:
        raise Bad(f"{at}: missing")
    return read(value, at, *extra)


def _texts(value: object, where: str) -> tuple[str, ...]:
    return tuple(_text(v, f"{where}[{i}]") for i, v in enumerate(_list(value, where)))


def _cut(value: object) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:39] + "…"


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    arch: str
    usable_cpus: int
    os: str
    key_flags: tuple[str, ...]

    def summary(self) -> str:
        """``CPU model (arch), N CPUs, OS`` (``runtime.machine.summary``)."""
        return f"{self.cpu_model} ({self.arch}), {self.usable_cpus} CPUs, {self.os}"


def _machine(value: object, at: str) -> Machine:
    return Machine(
        *(_req(_text, value, at, k) for k in ("cpu_model", "arch")),
        _req(_count, value, at, "usable_cpus"),
        _req(_text, value, at, "os"),
        _opt(_texts, value, at, "key_flags") or (),
    )


@dataclass(frozen=True)
class Load:
    before: float | None
    after: float | None
    other_share: float | None


def _load(value: object, at: str) -> Load:
    first = [
        _number(found[0], f"{at}.{k}[0]") if found else None
        for k in ("before", "after")
        for found in [_opt(_list, value, at, k)]
    ]
    return Load(*first, _opt(_number, value, at, "other_processes_share"))


@dataclass(frozen=True)
class Versions:
    base: str
    patched: str
    patch: str


@dataclass(frozen=True)
class Model:
    name: str | None
    description: str | None
    random_weights: bool


def _model(value: object, at: str) -> Model:
    weights, _ = _get(value, at, "random_weights")
    return Model(
        _opt(_text, value, at, "name"),
        _opt(_text, value, at, "description"),
        weights is True,
    )


@dataclass(frozen=True)
class Sizes:
    num_prompts: int
    input_len: int
    output_len: int
    max_concurrency: int


@dataclass(frozen=True)
class Serving:
    commands: tuple[str, ...]
    sizes: Sizes | None
    configs: dict[str, dict[str, dict[str, tuple[float, ...]]]]
    """Per mode (``MODES``), side (``SERVED``) and metric (``METRICS``)."""
    server_log: dict[str, dict[str, tuple[str, ...]]]


def _numbers(value: object, at: str) -> tuple[float, ...]:
    found = tuple(_number(v, f"{at}[{i}]") for i, v in enumerate(_list(value, at)))
    if not found:
        raise Bad(f"{at}: no numbers")
    return found


def _serving(value: object, at: str) -> Serving:
    configs: dict = {}
    for mode, sides in _req(_table, value, at, "configs", MODES).items():
        where = f"{at}.configs.{mode}"
        for side, metrics in _table(sides, where, SERVED).items():
            here = f"{where}.{side}"
            configs.setdefault(mode, {})[side] = {
                m: _numbers(v, f"{here}.{m}")
                for m, v in _table(metrics, here, METRICS).items()
            }
    logged: dict = {}
    for mode, sides in (_opt(_table, value, at, "server_log", MODES) or {}).items():
        where = f"{at}.server_log.{mode}"
        logged[mode] = {
            side: _texts(lines or [], f"{where}.{side}")
            for side, lines in _table(sides, where, SERVED).items()
        }
    sizes = _opt(_table, value, at, "sizes")
    return Serving(
        _opt(_texts, value, at, "commands") or (),
        sizes
        and Sizes(
            *(_req(_count, sizes, f"{at}.sizes", k) for k in Sizes.__annotations__)
        ),
        configs,
        logged,
    )


@dataclass(frozen=True)
class Divergence:
    """Where greedy tokens first part, counted from 0 (``mode``: over all)."""

    prompt: int
    position: int
    mode: str | None = None


def _divergence(value: object, at: str) -> Divergence:
    return Divergence(
        _req(_count, value, at, "prompt"),
        _req(_count, value, at, "position"),
        _opt(_text, value, at, "mode"),
    )


@dataclass(frozen=True)
class TokenMode:
    identical: int
    prompts: int
    first: Divergence | None
    max_dlogprob: float


@dataclass(frozen=True)
class Tokens:
    prompts: int | None
    tokens: int | None
    first: Divergence | None
    max_dlogprob: float | None
    note: str | None
    configs: dict[str, TokenMode]


def _token_mode(found: object, where: str) -> TokenMode:
    """``accuracy.compare``'s verdict on one pair of sides."""
    return TokenMode(
        _req(_count, found, where, "identical_prompts"),
        len(_req(_list, found, where, "per_prompt", MOST_ROWS)),
        _opt(_divergence, found, where, "first_divergence"),
        _req(_number, found, where, "max_abs_dlogprob"),
    )


def _tokens(value: object, at: str) -> Tokens:
    configs = {
        mode: _token_mode(found, f"{at}.configs.{mode}")
        for mode, found in (_opt(_table, value, at, "configs", MODES) or {}).items()
    }
    return Tokens(
        *(_opt(_count, value, at, k) for k in ("prompts", "tokens")),
        _opt(_divergence, value, at, "first_divergence"),
        _opt(_number, value, at, "max_abs_dlogprob"),
        _opt(_text, value, at, "note"),
        configs,
    )


@dataclass(frozen=True)
class LmEval:
    task: str
    mode: str | None
    limit: int | None
    filter: str | None
    scores: dict[str, tuple[float, float]]
    """Per side measured: exact_match and its stderr."""


def _lm_eval(value: object, at: str) -> LmEval:
    scores, filters = {}, []
    for side in SIDES:
        found, where = _get(value, at, side)
        if found is not None:
            scores[side] = tuple(
                _req(_number, found, where, k) for k in ("exact_match", "stderr")
            )
            filters.append(_opt(_text, found, where, "filter"))
    return LmEval(
        _req(_text, value, at, "task"),
        _opt(_text, value, at, "mode"),
        _opt(_count, value, at, "limit"),
        next(iter(filters), None),
        scores,
    )


@dataclass(frozen=True)
class PerOpRow:
    env: str
    op: str
    tokens: int
    route: str
    median_us: float | None
    native_us: float | None
    wrong: str | None
    """Why this route was not timed: outside the op's tolerance."""
    p10_us: float | None = None
    p90_us: float | None = None
    impl: str | None = None
    """A layer route's: what the layer ran, ``kernel`` or ``native``."""


@dataclass(frozen=True)
class ChildLoad:
    env: str
    load_average: float
    other_share: float


@dataclass(frozen=True)
class PerOp:
    hidden_size: int
    dtype: str
    threads: int
    rows: tuple[PerOpRow, ...]
    clock: str | None = None
    load: tuple[ChildLoad, ...] = ()


def _perop(value: object, at: str) -> PerOp:
    rows = []
    for i, row in enumerate(_req(_list, value, at, "rows", MOST_ROWS)):
        where = f"{at}.rows[{i}]"
        wrong = _opt(_text, row, where, "wrong")
        timed = (None, None) if wrong else (
            _req(_time, row, where, k) for k in ("median_us", "native_us")
        )  # fmt: skip
        rows.append(
            PerOpRow(
                *(_req(_text, row, where, k) for k in ("env", "op")),
                _req(_count, row, where, "tokens"),
                _req(_text, row, where, "route"),
                *timed,
                wrong,
                *(_opt(_time, row, where, k) for k in ("p10_us", "p90_us")),
                _opt(_text, row, where, "impl"),
            )
        )
    if len({(r.env, r.route) for r in rows}) > MOST_COLUMNS:
        raise Bad(f"{at}.rows: more than {MOST_COLUMNS} (env, route) pairs")
    loads = tuple(
        ChildLoad(
            _req(_text, x, f"{at}.load[{i}]", "env"),
            *(
                _req(_number, x, f"{at}.load[{i}]", k)
                for k in ("load_average", "other_share")
            ),
        )
        for i, x in enumerate(_opt(_list, value, at, "load") or [])
    )
    return PerOp(
        _req(_count, value, at, "hidden_size"),
        _req(_text, value, at, "dtype"),
        _req(_count, value, at, "threads"),
        tuple(rows),
        _opt(_text, value, at, "clock"),
        loads,
    )


@dataclass(frozen=True)
class Numerics:
    needed: dict[str, dict[str, dict[str, float | str]]]
    """Per kernel build, op and dtype: the rtol needed, or why none."""
    tolerance: dict[str, dict[str, tuple[float, float]]]
    """Per op and dtype: vLLM's own rtol and atol."""


def _needed(value: object, at: str) -> float | str:
    return value if isinstance(value, str) and _text(value, at) else _number(value, at)


def _numerics(value: object, at: str, doc: object) -> Numerics:
    needed = {
        build: {
            op: {
                dtype: _needed(v, f"{at}.{build}.{op}.{dtype}")
                for dtype, v in _table(dtypes, f"{at}.{build}.{op}").items()
            }
            for op, dtypes in _table(ops, f"{at}.{build}").items()
        }
        for build, ops in _table(value, at).items()
    }
    if sum(len(d) for ops in needed.values() for d in ops.values()) > MOST_ROWS:
        raise Bad(f"{at}: more than {MOST_ROWS} figures")
    tolerance = {}
    for op, dtypes in (_opt(_table, doc, "", "tolerance") or {}).items():
        for dtype, pair in _table(dtypes, f"tolerance.{op}").items():
            where = f"tolerance.{op}.{dtype}"
            if len(_list(pair, where)) != 2:
                raise Bad(f"{where}: not [rtol, atol]")
            found = tuple(_number(v, where) for v in pair)
            tolerance.setdefault(op, {})[dtype] = found
    return Numerics(needed, tolerance)


QWEN3_SIDES = ("base", "patched", "unguarded")
"""The eager Qwen3 comparison's sides: vLLM as installed, with the change, and
the kernels for every input (as before vLLM #31643)."""


@dataclass(frozen=True)
class Qwen3Side:
    kernel_calls: tuple[int, ...]
    """Per kernel (rms_norm, fused add), in one prefill and one decode step."""
    distinct_share: tuple[float, ...]
    """Per completion, its distinct tokens over its tokens."""
    texts: tuple[str, ...]


@dataclass(frozen=True)
class Qwen3Eager:
    """``bench --qwen3`` (``bench.qwen3_eager.summarize``)."""

    description: str
    patch: str
    prompts: int
    max_tokens: int
    sides: dict[str, Qwen3Side]
    against: dict[str, TokenMode]
    """``patched`` and ``unguarded`` against ``base``."""


def _qwen3_side(value: object, at: str) -> Qwen3Side:
    calls = _req(_table, value, at, "kernel_calls")
    return Qwen3Side(
        tuple(_count(v, f"{at}.kernel_calls.{k}") for k, v in calls.items()),
        _req(_numbers, value, at, "distinct_share"),
        _req(_texts, value, at, "texts"),
    )


def qwen3_eager(value: object, at: str = "qwen3_eager") -> Qwen3Eager:
    """The eager Qwen3 comparison as a record, or ``Bad``."""
    sides = _req(_table, value, at, "sides", QWEN3_SIDES)
    if set(sides) != set(QWEN3_SIDES):
        raise Bad(f"{at}.sides: not {', '.join(QWEN3_SIDES)}")
    return Qwen3Eager(
        _req(_text, _req(_table, value, at, "model"), f"{at}.model", "description"),
        _req(_text, value, at, "patch"),
        len(_req(_list, value, at, "prompts")),
        _req(_count, value, at, "max_tokens"),
        {side: _qwen3_side(sides[side], f"{at}.sides.{side}") for side in QWEN3_SIDES},
        {s: _req(_token_mode, value, at, s) for s in QWEN3_SIDES[1:]},
    )


@dataclass(frozen=True)
class Interval:
    """An estimate (a ratio, milliseconds or a share) and its 95% interval."""

    value: float
    low: float
    high: float


def _interval(value: object, at: str, key: str) -> Interval:
    found = _req(_number, value, at, key)
    return Interval(found, *_req(_pair, value, at, "ci95"))


def _pair(value: object, at: str) -> tuple[float, float]:
    if len(_list(value, at)) != 2:
        raise Bad(f"{at}: not [low, high]")
    return _number(value[0], f"{at}[0]"), _number(value[1], f"{at}[1]")


@dataclass(frozen=True)
class Comparison:
    cpu: Interval
    wall: Interval | None
    pairs: int


@dataclass(frozen=True)
class Saving:
    ms: Interval
    share: Interval
    expected: tuple[float, float]
    """The step ratio the saving implies."""


@dataclass(frozen=True)
class DecodeBlock:
    """One thread count's (or the compiled pair's) decode figures."""

    comparisons: dict[str, Comparison]
    step_ms: dict[str, tuple[Interval, Interval | None]]
    """Per engine: CPU and wall milliseconds per decode step."""
    norm_ms: dict[str, tuple[Interval, Interval | None]]
    """Per eager engine: the same inside ``RMSNorm``."""
    norm_calls: float | None
    savings: dict[str, Saving]
    contradicts: bool | None
    rounds: int
    busy_rounds: int


def _ms(b: object, at: str, key: str) -> dict:
    """Per engine, ``key``'s CPU and ``{key}``'s wall twin's milliseconds."""
    wall_key = key.replace("_ms", "_wall_ms")
    wall = _opt(_table, b, at, wall_key) or {}
    return {
        name: (
            _interval(found, f"{at}.{key}.{name}", "ms"),
            _opt(_interval, wall, f"{at}.{wall_key}", name, "ms"),
        )
        for name, found in (_opt(_table, b, at, key) or {}).items()
    }


def _decode_block(b: object, at: str) -> DecodeBlock:
    comparisons = {
        label: Comparison(
            _interval(c, f"{at}.comparisons.{label}", "ratio"),
            _opt(_interval, c, f"{at}.comparisons.{label}", "wall", "ratio"),
            _req(_count, c, f"{at}.comparisons.{label}", "n"),
        )
        for label, c in _req(_table, b, at, "comparisons").items()
    }
    savings = {
        side: Saving(
            _req(_interval, found, f"{at}.savings.{side}", "saving_ms", "ms"),
            _req(_interval, found, f"{at}.savings.{side}", "share", "share"),
            _req(_pair, found, f"{at}.savings.{side}", "expected_ratio"),
        )
        for side, found in (_opt(_table, b, at, "savings") or {}).items()
    }
    consistent = _opt(_table, b, at, "consistent")
    return DecodeBlock(
        comparisons,
        _ms(b, at, "step_ms"),
        _ms(b, at, "norm_ms"),
        _opt(_number, b, at, "norm_calls_per_step"),
        savings,
        None if consistent is None else consistent.get("contradicts") is True,
        _req(_count, b, at, "rounds"),
        _req(_count, b, at, "busy_rounds"),
    )


@dataclass(frozen=True)
class Decode:
    """``bench --decode``: one decode step, base against patched."""

    model: str
    dtype: str
    threads: int
    kernel_build: str
    tokens: int
    headline: DecodeBlock | None
    by_threads: dict[str, DecodeBlock]
    compiled: dict[str, DecodeBlock]


def _decode(d: object, at: str) -> Decode:
    model = _req(_table, d, at, "model")
    named = _opt(_text, model, f"{at}.model", "name")
    blocks = {
        part: {
            n: _decode_block(b, f"{at}.{part}.{n}")
            for n, b in (_opt(_table, d, at, part) or {}).items()
        }
        for part in ("by_threads", "compiled")
    }
    return Decode(
        named or _opt(_text, model, f"{at}.model", "description") or "the model",
        _req(_text, d, at, "dtype"),
        _req(_count, d, at, "threads"),
        _req(_text, d, at, "kernel_build"),
        _req(_count, d, at, "tokens"),
        _decode_block(d, at) if _get(d, at, "comparisons")[0] is not None else None,
        blocks["by_threads"],
        blocks["compiled"],
    )


@dataclass(frozen=True)
class Evidence:
    machine: Machine | None
    load: Load | None
    vllm: Versions | None
    model: Model | None
    serving: Serving | None
    tokens: Tokens | None
    lm_eval: LmEval | None
    numerics: Numerics | None
    perop: PerOp | None
    qwen3: Qwen3Eager | None = None
    decode: Decode | None = None
    interrupted: bool = False
    failed: tuple[str, ...] = ()
    perop_threads: tuple[PerOp, ...] = ()
    """``perop`` at the other thread counts of the run."""


def parse(doc: object) -> Evidence:
    """``doc`` (``evidence.json`` loaded) as records, or ``Bad`` naming the
    first field that is not what ``bench`` writes. A part still empty (a run
    in progress) is None."""
    if _get(doc, "", "schema")[0] != SCHEMA:
        raise Bad(f"no `schema: {SCHEMA}`")
    vllm = _opt(_table, doc, "", "vllm") or None
    accuracy = _opt(_table, doc, "", "accuracy") or {}
    model = _opt(_table, doc, "", "model")
    return Evidence(
        _opt(_machine, doc, "", "machine"),
        _opt(_load, doc, "", "load"),
        vllm
        and Versions(
            *(_req(_text, vllm, "vllm", k) for k in ("base", "patched", "patch"))
        ),
        _model(model, "model") if model else None,
        _opt(_serving, doc, "", "serving"),
        _opt(_tokens, accuracy, "accuracy", "tokens"),
        _opt(_lm_eval, accuracy, "accuracy", "lm_eval"),
        _opt(_numerics, doc, "", "numerics", doc),
        _opt(_perop, doc, "", "perop"),
        _opt(qwen3_eager, doc, "", "qwen3_eager"),
        _opt(_decode, doc, "", "decode"),
        _get(doc, "", "interrupted")[0] is True,
        _opt(_texts, doc, "", "failed") or (),
        tuple(
            _perop(found, f"perop_threads[{i}]")
            for i, found in enumerate(
                _opt(_list, doc, "", "perop_threads", MOST_THREADS) or []
            )
        ),
    )


def read(folder: Path) -> Evidence:
    """``folder``'s evidence (the folder is the user's choice; the file in it a
    regular file, never a link, read by ``patcher.files``), or one ``PatchError``."""
    from patcher.files import read_text_at

    path = Path(os.path.realpath(folder)) / EVIDENCE
    what = "a vllm-patch bench evidence file"
    try:
        return parse(json.loads(read_text_at(path, what)))
    except (ValueError, RecursionError) as exc:  # bad, or nested too deep
        found = f"{type(exc).__name__}: {exc}"
        raise PatchError(
            "not JSON", path=str(path), looked_for=what, found=found
        ) from exc
    except Bad as exc:
        raise PatchError(
            "not usable evidence", path=str(path), looked_for=what, found=str(exc)
        ) from exc
