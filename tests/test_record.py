"""``bench``'s evidence as records: a run's document written by ``to_json``
is read back (``record.read``) as the same records, and ``evidence.md`` from
the records the run built is the one from the file read back."""

from __future__ import annotations

import json

from test_bench import decode_record, runs
from test_qwen3_eager import PROMPTS, side

from vllm_patch.bench import accuracy, qwen3_eager, record, report
from vllm_patch.bench import run as bench_run


def completions(*tokens: list[int]) -> list[accuracy.Completion]:
    return [
        accuracy.Completion(tokens=tuple(t), logprobs=tuple(-0.5 for _ in t))
        for t in tokens
    ]


def serving_record() -> record.Serving:
    sizes = record.Sizes(
        input_len=128,
        output_len=128,
        num_prompts=32,
        max_concurrency=4,
        model_len=0,
    )
    configs = {"eager": {s: runs(10.0, 12.5) for s in ("base", "patched", "base2")}}
    return record.Serving(
        commands=("vllm serve MODEL --port PORT", "vllm bench serve"),
        sizes=sizes,
        configs={m: {s: dict(v) for s, v in d.items()} for m, d in configs.items()},
        server_log={"eager": {"base": ("rms_norm=['native']",)}},
    )


def accuracy_record() -> record.Accuracy:
    tokens = record.Tokens(
        prompts=2, tokens=3, note=None, prompt_texts=("The capital", "Water boils")
    )
    same = accuracy.compare(
        completions([1, 2, 3], [4, 5]), completions([1, 2, 3], [4, 5])
    )
    parted = accuracy.compare(
        completions([1, 2, 3], [4, 5]), completions([1, 9, 3], [4, 5])
    )
    tokens = accuracy.with_mode(tokens, "eager", same)
    tokens = accuracy.with_mode(tokens, "compiled", parted)
    lm_eval = record.LmEval(
        task="gsm8k",
        limit=None,
        include_path=None,
        mode="eager",
        command="lm_eval --model local-completions",
        base=record.Score(exact_match=0.25, stderr=0.01, filter="strict-match"),
        patched=record.Score(exact_match=0.26, stderr=0.01, filter="strict-match"),
    )
    return record.Accuracy(tokens=tokens, lm_eval=lm_eval)


def likelihood_record() -> record.Likelihood:
    return record.Likelihood(
        record.LikelihoodResult(
            dtype="float32",
            build="_C_AVX2",
            text="the GNU GPL",
            text_sha256="ab",
            chunk=512,
            tokens=2044,
            nats_per_token={"base": 2.69, "patched": 2.6901},
            difference={"patched": record.Interval(1e-4, -2e-4, 4e-4, 4)},
            seconds={"base": 30.0, "patched": 31.0},
        ),
        record.GreedyResult(
            dtype="float32",
            build="_C_AVX2",
            prompts=("Hi", "Why?"),
            max_tokens=16,
            divergence={"patched": [None, 7]},
            base_answers=["Hello", "Because"],
        ),
        {"base": {"threads": 1, "norm_classes": ["RMSNorm"], "loaded": ["_C"]}},
    )


def perop_record(threads: int) -> record.PerOp:
    rows = (
        record.PerOpRow(
            env="both",
            op="rms_norm",
            dtype="bfloat16",
            tokens=1,
            route="native",
            median_us=20.0,
            p10_us=19.0,
            p90_us=21.0,
            native_us=20.0,
        ),
        record.PerOpRow(
            env="patched",
            op="rms_norm",
            dtype="bfloat16",
            tokens=1,
            route="layer:RMSNorm",
            impl="kernel",
            median_us=10.0,
            native_us=20.0,
        ),
    )
    load = (record.ChildLoad(env="patched", load_average=0.5, other_share=0.1),)
    return record.PerOp(
        hidden_size=2048,
        dtype="bfloat16",
        threads=threads,
        clock="cpu",
        rounds=3,
        load=load,
        rows=rows,
    )


def qwen3_record() -> record.Qwen3Eager:
    base = side([[7, 8, 9], [10, 11, 12]], [[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    unguarded = side(
        [[7, 8, 9], [10, 13, 13]], [[-1.0, -2.0, -3.0], [-1.5, -0.5, -9.0]]
    )
    found = {"base": base, "patched": base, "unguarded": unguarded}
    return qwen3_eager.summarize(found, PROMPTS, "rms_norm_forward_cpu")


def filled(run: bench_run.BenchRun) -> None:
    """Every section ``bench`` writes, in the order a run with every part
    reaches them, as the producers build them."""
    run.doc["vllm"] = record.Versions(base="0.32.0", patched="0.32.0", patch="p")
    run.doc["model"] = record.Model(
        path="/models/m",
        name="m (LlamaForCausalLM)",
        description="m, a local folder",
    )
    run.doc["decode"] = decode_record()
    run.doc["decode_dtypes"] = (decode_record(seed=4),)
    run.save()
    run.doc["likelihood"] = (likelihood_record(),)
    run.doc["serving"] = serving_record()
    run.doc["accuracy"] = accuracy_record()
    run.doc["numerics"] = {
        "_C_AVX2": {"rms_norm": {"bfloat16": 0.01, "float32": "why"}}
    }
    run.doc["tolerance"] = {"rms_norm": {"bfloat16": record.Tolerance(0.016, 1e-5)}}
    run.doc["perop"] = perop_record(1)
    run.doc["perop_threads"] = (perop_record(2),)
    run.doc["qwen3_eager"] = qwen3_record()
    run.doc["failed"].append("serve: RuntimeError: a server ended")
    run.doc["interrupted"] = True
    run.save()


def test_evidence_json_reads_back_as_the_records_written(tmp_path):
    run = bench_run.BenchRun(tmp_path / "out", print)
    filled(run)
    text = (tmp_path / "out" / record.EVIDENCE).read_text("utf-8")
    written = json.loads(text)
    assert list(written) == list(run.doc)  # the run's order, sections as reached
    assert text == json.dumps(record.to_json(run.doc), indent=1) + "\n"
    found = record.read(tmp_path / "out")
    again = record.to_json(found)
    for name, section in written.items():  # each section: the same bytes
        assert json.dumps(again[name], indent=1) == json.dumps(section, indent=1), (
            name
        )
    assert found.decode == run.doc["decode"] and found.perop == run.doc["perop"]
    assert found.likelihood == run.doc["likelihood"]
    assert found.qwen3_eager == run.doc["qwen3_eager"]
    assert found.accuracy.tokens.first_divergence == record.Divergence(
        mode="compiled", prompt=0, position=1
    )


def test_evidence_md_is_the_same_from_the_records_and_from_the_file(tmp_path):
    run = bench_run.BenchRun(tmp_path / "out", print)
    filled(run)
    markdown = (tmp_path / "out" / "evidence.md").read_text("utf-8")
    assert markdown == report.evidence_markdown(run.evidence())
    assert markdown == report.evidence_markdown(record.read(tmp_path / "out"))
    for heading in ("## Decode step", "## Serving, eager", "## Accuracy", "Qwen3"):
        assert heading in markdown
    assert "**Interrupted**" in markdown and "**Failed:** serve:" in markdown


def test_a_null_is_written_where_the_format_says():
    """``path`` always; a local folder's ``context`` even when unknown; the
    earliest divergence once a mode is compared, none before."""
    model = record.to_json(record.Model(name="SmolLM2"))
    assert model == {"path": None, "random_weights": False, "name": "SmolLM2"}
    folder = record.to_json(record.Model(path="/m", name="m"))
    assert folder == {
        "path": "/m",
        "random_weights": False,
        "name": "m",
        "context": None,
    }
    tokens = record.Tokens(prompts=2, tokens=3, prompt_texts=("a", "b"))
    assert "first_divergence" not in record.to_json(tokens)
    same = accuracy.compare(completions([1], [2]), completions([1], [2]))
    compared = record.to_json(accuracy.with_mode(tokens, "eager", same))
    assert list(compared)[-2:] == ["first_divergence", "max_abs_dlogprob"]
    assert compared["first_divergence"] is None
