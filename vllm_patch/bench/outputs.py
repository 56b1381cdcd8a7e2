"""The files a bench run leaves: ``bench.json`` (the result document),
``bench.md``, ``machine.md`` and ``perop_ratios.png``, all rendered from the
document."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from patcher.files import output_dir, write_output
from vllm_patch.bench import chart, markdown


def write_outputs(doc: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write every output of ``doc`` into ``out``; their paths by kind. Never
    through a link or special file found there (``write_output``)."""
    out = output_dir(out)
    text = markdown.markdown(doc)
    paths = {
        "json": write_output(out / "bench.json", json.dumps(doc, indent=1) + "\n"),
        "machine": write_output(out / "machine.md", markdown.machine_markdown(doc)),
    }
    with tempfile.TemporaryDirectory(prefix="vllm-patch-chart-") as tmp:
        png = chart.chart(doc, Path(tmp) / "perop_ratios.png")
        if png is not None:
            paths["chart"] = write_output(out / png.name, png.read_bytes())
        else:
            text += f"\n{chart.NO_CHART}\n"
    paths["markdown"] = write_output(out / "bench.md", text)
    return {k: paths[k] for k in ("json", "markdown", "machine", "chart") if k in paths}
