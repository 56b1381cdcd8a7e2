"""Give ``RMSNorm`` a ``forward_cpu`` that calls vLLM's CPU kernels.

vLLM's ``CustomOp`` dispatch calls ``forward_cpu`` on CPU for an enabled op;
``CustomOp.forward_cpu`` falls back to ``forward_native``, and ``RMSNorm``
defines none, so on CPU every norm runs the PyTorch form although the CPU build
ships ``torch.ops._C.rms_norm`` and ``fused_add_rms_norm``. The method added
here is ``GELU.forward_cpu``'s idiom (``vllm/model_executor/layers/activation.py``):
the kernel for the inputs it handles, ``forward_native`` for the rest. Whether it
runs is vLLM's own rule, decided on the final compilation config: custom ops are
enabled when not compiling with Inductor (``custom_ops: ["all"]``) and disabled
when Inductor compiles (``["none"]``: native, which Inductor fuses), and
``+rms_norm`` / ``-rms_norm`` override it. Only ``layernorm.py`` changes.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.codemod import TreeCodemod
from patcher.ruff_format import format_member

CLASS = "RMSNorm"
METHOD = "forward_cpu"
AFTER = "forward_native"

# The release's spelling of "batch invariance is on": a function before 0.19,
# then the environment flag.
BATCH_INVARIANT = {
    "vllm_is_batch_invariant": "vllm_is_batch_invariant()",
    "envs": "envs.VLLM_BATCH_INVARIANT",
}

METHOD_TEMPLATE = """\
def forward_cpu(
    self,
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # The CPU kernels ignore strides and need a weight of the input's dtype and
    # a hidden size that is a multiple of 8. Other inputs, a weightless norm, a
    # variance size override and batch invariance take the native path.
    if (
        {batch_invariant}
        or not self.has_weight
        or self.variance_size_override is not None
        or x.shape[-1] % 8 != 0
        or self.weight.dtype != x.dtype
        or not x.is_contiguous()
    ):
        return self.forward_native(x, residual)
    if residual is None:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, self.weight.data, self.variance_epsilon)
        return out
    # Built for CPUs without AVX512-BF16, the kernels truncate to bfloat16
    # where torch rounds: twice in the fused add, which takes its bfloat16
    # output beyond test_layernorm.py's tolerance, so it stays native there.
    if not residual.is_contiguous() or (
        x.dtype == torch.bfloat16 and not torch.cpu._is_avx512_bf16_supported()
    ):
        return self.forward_native(x, residual)
    torch.ops._C.fused_add_rms_norm(
        x, residual, self.weight.data, self.variance_epsilon
    )
    return x, residual
"""

NAMED = m.FunctionDef(name=m.Name(METHOD))
ANCHOR = m.FunctionDef(name=m.Name(AFTER))


def _imported_names(module: cst.Module) -> set[str]:
    """The names the module's top-level imports bind."""
    return {
        alias.evaluated_alias or alias.evaluated_name
        for stmt in module.body
        if isinstance(stmt, cst.SimpleStatementLine)
        for small in stmt.body
        if isinstance(small, (cst.Import, cst.ImportFrom))
        and not isinstance(small.names, cst.ImportStar)
        for alias in small.names
    }


class AddRmsNormForwardCpu(TreeCodemod):
    DESCRIPTION = (
        f"Add {CLASS}.{METHOD}: vLLM's CPU rms_norm and fused_add_rms_norm "
        "kernels for the inputs they handle, forward_native for the rest."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        at, cls = self.top_level_class(tree, CLASS)
        body = list(cls.body.body)
        if any(m.matches(s, NAMED) for s in body):
            return tree  # already there, ours or upstream's
        anchors = [i for i, s in enumerate(body) if m.matches(s, ANCHOR)]
        if not anchors:
            raise self.shape_error(f"{CLASS}.{AFTER}", "no such method")
        imported = _imported_names(tree)
        spelling = next((s for n, s in BATCH_INVARIANT.items() if n in imported), None)
        if spelling is None:
            raise self.shape_error(
                "an import of vllm_is_batch_invariant or vllm.envs",
                "neither is imported",
            )
        method = format_member(
            METHOD_TEMPLATE.format(batch_invariant=spelling), tree
        ).with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        body.insert(anchors[0] + 1, method)
        self.record(
            f"`{CLASS}.{METHOD}` is added: `torch.ops._C.rms_norm` and "
            "`torch.ops._C.fused_add_rms_norm` for contiguous inputs with a "
            "weight of their dtype and a hidden size that is a multiple of 8 "
            "(the fused add in bfloat16 only on CPUs with AVX512-BF16, whose "
            "kernels round); `forward_native` for the rest, a weightless norm, "
            f"a variance size override and batch invariance (`{spelling}`)"
        )
        return self.with_body(tree, at, cls, body)


class RemoveRmsNormForwardCpu(TreeCodemod):
    DESCRIPTION = f"Undo AddRmsNormForwardCpu: drop {CLASS}.{METHOD}."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        at, cls = self.top_level_class(tree, CLASS)
        body = [s for s in cls.body.body if not m.matches(s, NAMED)]
        if len(body) == len(cls.body.body):
            return tree
        self.record(f"`{CLASS}.{METHOD}` is removed")
        return self.with_body(tree, at, cls, body)
