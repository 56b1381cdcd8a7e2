"""``python -m vllm_patch``: the ``vllm-patch`` command. Plain ``-m`` puts the
working folder first on ``sys.path`` and imports the package ``vllm_patch``
from there if it holds one, before any of this code runs: in a folder someone
else prepared, run ``vllm-patch`` or ``python -P -m vllm_patch`` (``-I`` before
Python 3.11), which never look there. This module refuses to run on top of a
``vllm_patch`` package that is not its own, and takes the working folder off
``sys.path`` before anything else is imported, so a ``vllm/`` (or ``torch/``,
``pip/``) planted there is never imported."""

import os
import sys

here = os.path.dirname(os.path.realpath(__file__))
imported = getattr(sys.modules.get("vllm_patch"), "__file__", None) or ""
if os.path.dirname(os.path.realpath(imported)) != here:
    print(
        f"vllm-patch: error: Python imported another vllm_patch package "
        f"({imported or 'a folder'}) from the working folder before this command "
        "ran; run `vllm-patch` or `python -P -m vllm_patch` there instead",
        file=sys.stderr,
    )
    raise SystemExit(2)
if not getattr(sys.flags, "safe_path", sys.flags.isolated) and sys.path:
    if sys.path[0] in ("", os.getcwd()):
        del sys.path[0]

from vllm_patch.cli import main  # noqa: E402 (after the path is cleaned)

raise SystemExit(main())
