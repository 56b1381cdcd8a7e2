"""What one ``RMSNorm`` call costs on CPU through the rule's ``forward_cpu``, next
to a minimal ``forward_cpu`` (allocate, call the kernel) and ``forward_native``:
the per-call overhead of deciding, where a decode step's norm is a few
microseconds of kernel. For ``bench --perop``; run in vLLM's environment."""

import functools
import statistics
import time

SHAPES = ((1, 2048), (1, 4096))
DTYPES = ("bfloat16", "float32")
VARIANTS = ("rule", "minimal", "native")


def _layers(hidden: int, dtype):
    """(the rule's layer, a minimal one), one weight, at the current threads."""
    import torch
    from vllm.model_executor.layers.layernorm import RMSNorm

    from patches.cpu_norm_rule import RMSNormForwardCpu

    class RuleRMSNorm(RMSNormForwardCpu, RMSNorm):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.bind_cpu_ops()

    class MinimalRMSNorm(RMSNorm):
        def forward_cpu(self, x, residual=None):
            if residual is None:
                out = torch.empty_like(x)
                torch.ops._C.rms_norm(
                    out, x, self.weight.data, self.variance_epsilon
                )
                return out
            torch.ops._C.fused_add_rms_norm(
                x, residual, self.weight.data, self.variance_epsilon
            )
            return x, residual

    rule = RuleRMSNorm(hidden).to(dtype)
    minimal = MinimalRMSNorm(hidden).to(dtype)
    minimal.weight.data = rule.weight.data
    return rule, minimal


def _per_call_us(call, calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        call()
    return (time.thread_time() - start) / calls * 1e6


def _row(rule, minimal, x, residual, rounds: int, calls: int) -> dict:
    """One op's three variants, interleaved within each round."""
    variants = {
        "rule": functools.partial(rule.forward_cpu, x, residual),
        "minimal": functools.partial(minimal.forward_cpu, x, residual),
        "native": functools.partial(rule.forward_native, x, residual),
    }
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for variant, call in variants.items():
            times[variant].append(_per_call_us(call, calls))
    row = {"kernel": x.dtype in rule.cpu_dtypes}
    for variant, t in times.items():
        row[variant] = {"median": statistics.median(t), "range": [min(t), max(t)]}
    return row


def measure(
    shapes=SHAPES, dtypes=DTYPES, rounds: int = 15, calls: int = 400, progress=None
) -> list[dict]:
    """Per shape, dtype and op, µs per call: the rule's ``forward_cpu``, a minimal
    one and ``forward_native``, ``rounds`` x ``calls`` calls each, the three
    interleaved within each round and timed in this thread's CPU time (one
    OpenMP thread: other processes' load is not counted). Each row: shape,
    dtype, op, whether the rule runs the kernel, and per variant the median and
    (min, max) of the rounds. The layers are built at the current thread count,
    which the rule reads (``cpu_threads_shared``)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config

    rows = []
    with set_current_vllm_config(VllmConfig()), torch.inference_mode():
        for shape in shapes:
            for name in dtypes:
                dtype = getattr(torch, name)
                rule, minimal = _layers(shape[-1], dtype)
                x = torch.randn(shape, dtype=dtype)
                residual = torch.randn(shape, dtype=dtype)
                for op, res in (
                    ("rms_norm", None),
                    ("fused_add_rms_norm", residual),
                ):
                    row = _row(rule, minimal, x, res, rounds, calls)
                    rows.append(
                        {"shape": list(shape), "dtype": name, "op": op, **row}
                    )
                    if progress:
                        progress(f"per call: {op} {name} {list(shape)}")
    return rows


def main() -> None:
    import torch

    torch.set_num_threads(1)
    for row in measure(progress=None):
        base = row["minimal"] if row["kernel"] else row["native"]
        print(
            f"{row['op']:19} {row['dtype']:8} {row['shape']}: "
            f"rule {row['rule']['median']:.2f} µs, minimal "
            f"{row['minimal']['median']:.2f}, native {row['native']['median']:.2f}"
            f" -> rule/{'minimal' if row['kernel'] else 'native'} "
            f"{row['rule']['median'] / base['median']:.3f}"
        )


if __name__ == "__main__":
    main()
