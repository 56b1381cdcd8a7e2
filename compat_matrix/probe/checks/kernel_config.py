"""Where the provider ends up in the IR op priority vLLM's own config builds:
first when a user names it, first by default only when opted in and eager,
native under Inductor, and standing down where vLLM already ranks ``vllm_c``;
and the opt-in variable passes vLLM's strict environment validation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from compat_matrix.probe.framework import (
    Fail,
    Probe,
    Skip,
    need_provider,
)
from compat_matrix.probe.provider_module import env_var
from compat_matrix.probe.vllm_ir import (
    UPSTREAM_PROVIDER,
    compiling_with_inductor,
    strict_environ_error,
    upstream_enabled_ops,
    vllm_config,
)
from vllm_patch.runtime.import_checks import explain


@dataclasses.dataclass
class _Findings:
    """What the kernel_config steps record: details, and each problem found."""

    details: dict[str, Any]
    problems: list[str] = dataclasses.field(default_factory=list)

    def expect(self, label: str, got: dict, want_first: dict[str, str]) -> None:
        self.details[label] = {"final": got, "expected_first": want_first}
        for op, first in want_first.items():
            if not got.get(op) or got[op][0] != first:
                self.problems.append(
                    f"{label}: {op} starts {got.get(op)}, expected {first!r} first"
                )


def check_kernel_config(p: Probe) -> tuple[str, dict]:
    need_provider(p)
    ops = _config_ops(p)
    supported = {op: op not in _unsupported_ops(p) for op in ops}
    redundant = upstream_enabled_ops(ops)
    opt_in_env = p.module.OPT_IN_ENV
    found = _Findings(
        {"ops": ops, "redundant": bool(redundant), "redundant_ops": redundant}
    )
    with env_var(opt_in_env, None):
        plain = _without_opt_in(p, ops, found)
    _strict_environ(opt_in_env, found)
    with env_var(opt_in_env, "1"):
        eager_want = {
            op: (p.name if supported[op] and op not in redundant else plain[op][0])
            for op in ops
        }
        _with_opt_in(ops, eager_want, found)
    if not redundant:
        for op in ops:
            if plain[op][0] == p.name:
                found.problems.append(
                    f"without {opt_in_env} the default already ranks {p.name!r}"
                )
    if found.problems:
        raise Fail(found.problems[0], found.details)
    return _passed(p, ops, supported, redundant, plain), found.details


def _config_ops(p: Probe) -> list[str]:
    """The provider's ops that vLLM's ``IrOpPriorityConfig`` has a field for."""
    try:
        from vllm.config.kernel import IrOpPriorityConfig
    except Exception as exc:
        raise Skip(f"vLLM's config does not import here: {explain(exc)}") from None
    fields = [f.name for f in dataclasses.fields(IrOpPriorityConfig)]
    ops = [op for op in p.ops if op in fields]
    if not ops:
        raise Skip(f"IrOpPriorityConfig has no field for {', '.join(p.ops)}")
    return ops


def _without_opt_in(p: Probe, ops: list[str], found: _Findings) -> dict[str, list]:
    """A user's priority naming the provider puts it first; returns the
    default priority (no opt-in, eager)."""
    found.expect(
        "user_priority",
        final_priority({op: [p.name] for op in ops}, compiled=False),
        {op: p.name for op in ops},
    )
    plain = final_priority(None, compiled=False)
    found.details["no_opt_in_eager"] = {"final": plain}
    return plain


def _strict_environ(opt_in_env: str, found: _Findings) -> None:
    refused = strict_environ_error({opt_in_env: "1"})
    found.details["opt_in_strict_environ"] = refused or "accepted"
    if refused:
        found.problems.append(
            f"with {opt_in_env}=1 vLLM's strict environment validation "
            f"(--fail-on-environ-validation) refuses to start: {refused}"
        )


def _with_opt_in(ops: list[str], eager_want: dict[str, str], found: _Findings) -> None:
    """Opted in: first in eager where supported, native under Inductor, and a
    user's ``["native"]`` wins."""
    found.expect("opt_in_eager", final_priority(None, compiled=False), eager_want)
    found.expect(
        "opt_in_inductor",
        final_priority(None, compiled=True),
        {op: "native" for op in ops},
    )
    found.expect(
        "opt_in_user_native",
        final_priority({op: ["native"] for op in ops}, compiled=False),
        {op: "native" for op in ops},
    )


def _passed(p: Probe, ops, supported, redundant, plain) -> str:
    opt_in_env = p.module.OPT_IN_ENV
    if redundant:
        return (
            f"redundant: this vLLM enables {UPSTREAM_PROVIDER!r} on CPU for "
            f"{', '.join(redundant)}, so the provider stands down from the default "
            "ranking and can be removed; ir_op_priority naming it still puts it first"
        )
    ranked = [op for op in ops if supported[op]]
    how = (
        f"with {opt_in_env}=1 {p.name!r} is first for eager ({', '.join(ranked)}) and "
        "native for Inductor; a user's ['native'] wins; vLLM's strict environment "
        "validation accepts the variable"
        if ranked
        else f"default ranking stays {plain[ops[0]][0]!r} ({p.name!r} unsupported here)"
    )
    return f"ir_op_priority naming {p.name!r} ends with it first; {how}"


def _unsupported_ops(p: Probe) -> list[str]:
    from vllm.ir.op import IrOp

    return [op for op in p.ops if not IrOp.registry[op].impls[p.name].supported]


def final_priority(
    user: dict[str, list[str]] | None, *, compiled: bool
) -> dict[str, list]:
    """The IR op priority vLLM's own config path ends with (``VllmConfig`` runs
    ``KernelConfig.set_platform_defaults``), as the engine builds it."""
    config = vllm_config(user, compiled=compiled)
    got = dataclasses.asdict(config.kernel_config.ir_op_priority)
    got["_compiling_with_inductor"] = compiling_with_inductor(config)
    if got["_compiling_with_inductor"] != compiled:
        raise Fail(
            f"could not build a {'compiled' if compiled else 'eager'} config: {got}"
        )
    return got
