"""``python -m vllm_patch``: the ``vllm-patch`` command. ``-m`` puts the working
folder first on ``sys.path``; it is taken off again before anything else is
imported, so a ``vllm/`` (or ``torch/``, ``pip/``) planted there is never
imported, as with the console script."""

import os
import sys

if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from vllm_patch.cli import main  # noqa: E402 (after the path is cleaned)

raise SystemExit(main())
