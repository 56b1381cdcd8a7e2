"""The files a bench run leaves: ``bench.json`` (the result document),
``bench.md``, ``machine.md`` and ``perop_ratios.png``, all rendered from the
document."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_patch.bench import chart, markdown


def write_outputs(doc: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write every output of ``doc`` into ``out``; their paths by kind."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "bench.json",
        "markdown": out / "bench.md",
        "machine": out / "machine.md",
    }
    paths["json"].write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    paths["markdown"].write_text(markdown.markdown(doc))
    paths["machine"].write_text(markdown.machine_markdown(doc))
    png = chart.chart(doc, out / "perop_ratios.png")
    if png is not None:
        paths["chart"] = png
    else:
        with paths["markdown"].open("a") as md:
            md.write(f"\n{chart.NO_CHART}\n")
    return paths
