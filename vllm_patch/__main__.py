"""``python -m vllm_patch``: the ``vllm-patch`` command. Plain ``-m`` puts the
working folder first on ``sys.path``; the install's start-up hook
(``vllm_patch.pth``) has imported this package before that, so a ``vllm_patch/``
planted there is never imported. Without the hook (``python -S``) Python may
import the planted one first: then this module refuses to run. It takes the
working folder off ``sys.path`` before importing anything else, so a planted
``vllm/`` (or ``torch/``, ``pip/``) is never imported either."""

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
